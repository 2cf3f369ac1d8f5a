//! GPU telemetry as inline SVG: utilisation (0–100 %) and memory (0 to the GPUs' total) over
//! the job's run, with the peak and mean in words beside it for screen readers and for
//! anyone who would rather read numbers.

use gpuci_protocol::agent::TelemetryPoint;
use maud::{html, Markup};

const W: f64 = 600.0;
const H: f64 = 120.0;

fn polyline(points: &[(f64, f64)], t_max: f64, y_max: f64) -> String {
    points
        .iter()
        .map(|(t, y)| {
            let x = if t_max > 0.0 { t / t_max * W } else { 0.0 };
            let y = if y_max > 0.0 { H - (y / y_max).clamp(0.0, 1.0) * H } else { H };
            format!("{x:.1},{y:.1}")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn gib(b: f64) -> String {
    format!("{:.1} GiB", b / (1u64 << 30) as f64)
}

/// Two charts: utilisation and memory. `memory_total`: the leased GPUs' memory together (the
/// memory chart's top), when known.
pub fn charts(points: &[TelemetryPoint], memory_total: Option<u64>) -> Markup {
    if points.is_empty() {
        return html! { p.muted { "No GPU samples yet." } };
    }
    let t_max = points.last().map_or(0.0, |p| p.t_s).max(1.0);
    let util: Vec<(f64, f64)> = points.iter().map(|p| (p.t_s, p.utilization_pct)).collect();
    let mem: Vec<(f64, f64)> = points.iter().map(|p| (p.t_s, p.memory_bytes as f64)).collect();
    let peak_util = util.iter().map(|p| p.1).fold(0.0, f64::max);
    let mean_util = util.iter().map(|p| p.1).sum::<f64>() / util.len() as f64;
    let peak_mem = mem.iter().map(|p| p.1).fold(0.0, f64::max);
    let mean_mem = mem.iter().map(|p| p.1).sum::<f64>() / mem.len() as f64;
    let mem_top = memory_total.map_or(peak_mem, |m| m as f64).max(peak_mem).max(1.0);
    let power: Vec<f64> = points.iter().filter_map(|p| p.power_watts).collect();
    let util_words = format!("GPU utilisation over {t_max:.0} s: mean {mean_util:.0} %, peak {peak_util:.0} %");
    let mem_words = format!("GPU memory over {t_max:.0} s: mean {}, peak {}", gib(mean_mem), gib(peak_mem));
    html! {
        div.charts {
            figure.chart {
                figcaption { "Utilisation " span.muted { "mean " (format!("{mean_util:.0}")) " %, peak " (format!("{peak_util:.0}")) " %" } }
                svg viewBox=(format!("0 0 {W} {H}")) preserveAspectRatio="none" role="img" aria-label=(util_words) {
                    polyline.util points=(polyline(&util, t_max, 100.0)) {}
                }
                div.axis { span { "0 s" } span { (format!("{t_max:.0} s")) } }
            }
            figure.chart {
                // "of" only with a known total: never "of 0.0 GiB" (the peak is not a total).
                figcaption { "Memory " span.muted { "mean " (gib(mean_mem)) ", peak " (gib(peak_mem)) @if let Some(m) = memory_total { " of " (gib(m as f64)) } } }
                svg viewBox=(format!("0 0 {W} {H}")) preserveAspectRatio="none" role="img" aria-label=(mem_words) {
                    polyline.mem points=(polyline(&mem, t_max, mem_top)) {}
                }
                div.axis { span { "0 s" } span { (format!("{t_max:.0} s")) } }
            }
            @if !power.is_empty() {
                p.muted { "Power: peak " (format!("{:.0}", power.iter().cloned().fold(0.0, f64::max))) " W, mean "
                    (format!("{:.0}", power.iter().sum::<f64>() / power.len() as f64)) " W" }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_scale_to_the_run_and_say_peak_and_mean() {
        let p =
            |t: f64, u: f64, m: u64| TelemetryPoint { t_s: t, utilization_pct: u, memory_bytes: m, power_watts: None };
        let html = charts(&[p(0.0, 0.0, 0), p(10.0, 100.0, 40 << 30)], Some(80 << 30)).into_string();
        assert!(html.contains("points=\"0.0,120.0 600.0,0.0\""), "{html}");
        assert!(html.contains("peak 100 %"));
        assert!(html.contains("0.0,120.0 600.0,60.0"), "memory at half of 80 GiB: {html}");
        assert!(html.contains("peak 40.0 GiB of 80.0 GiB"));
    }

    /// Regression: live updates drew the chart without the GPUs' total, and it said
    /// "of 0.0 GiB". Without a total it names none.
    #[test]
    fn an_unknown_total_is_not_shown_as_zero() {
        let p = TelemetryPoint { t_s: 1.0, utilization_pct: 0.0, memory_bytes: 0, power_watts: None };
        let html = charts(&[p], None).into_string();
        assert!(!html.contains(" of "), "{html}");
    }
}
