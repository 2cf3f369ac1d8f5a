//! A deterministic synthetic trace: two weeks of GPU CI on three pools (`t4`, `a100`,
//! `h100x2`), about 170,000 jobs. Pushes arrive as a Poisson process whose rate follows the
//! working day (peak at 14:00 UTC, a fifth of it at night) and the week (weekends at 30 %).
//! A push is to a pull request (70 %: groups `prN-POOL`, `cancel_in_progress = 1`, so a newer
//! push cancels the older one's jobs) or to main (groups `main-POOL`, never cancelled); it
//! fans out into 1–3 `t4` shards, sometimes 1–2 `a100` jobs and sometimes one 2-GPU `h100x2`
//! job. One push in ten is followed by 1–3 fix-up pushes to the same pull request within
//! ten minutes: the bursts that cancel work in flight. No real project's data.

use crate::rng::Rng;
use crate::trace::TraceJob;

/// Two weeks from Monday 00:00, about 170,000 jobs; the same seed gives the same trace.
pub fn two_weeks(seed: u64) -> Vec<TraceJob> {
    generate(seed, 14, 170_000)
}

/// `days` days from a Monday 00:00 with about `target_jobs` jobs.
pub fn generate(seed: u64, days: u32, target_jobs: u32) -> Vec<TraceJob> {
    generate_with(seed, days, target_jobs, false)
}

/// As [`generate`], and every push first runs a build with no GPU (lognormal, median 3
/// minutes) that its GPU jobs wait on (`after`): the fan-out of a pipeline whose tests need
/// the build. The GPU jobs are the same as [`generate`]'s for the seed; the builds are drawn
/// from a stream of their own.
pub fn pipelines(seed: u64, days: u32, target_jobs: u32) -> Vec<TraceJob> {
    generate_with(seed, days, target_jobs, true)
}

fn generate_with(seed: u64, days: u32, target_jobs: u32, builds: bool) -> Vec<TraceJob> {
    let minutes = u64::from(days) * 1440;
    let shape = |minute: u64| -> f64 {
        let day = (minute / 1440) % 7;
        let hour = (minute % 1440) as f64 / 60.0;
        let week = if day < 5 { 1.0 } else { 0.3 };
        week * (0.2 + (-((hour - 14.0) / 4.0).powi(2)).exp())
    };
    let total_shape: f64 = (0..minutes).map(shape).sum();
    // Expected jobs per push: t4 2 + a100 0.45 × 1.5 + h100 0.12 ≈ 2.8; with fix-up bursts
    // (10 % × 2 more pushes, fewer near the end) ≈ 1.14 pushes per arrival, measured.
    let jobs_per_arrival = (2.0 + 0.45 * 1.5 + 0.12) * 1.14;
    let per_shape = f64::from(target_jobs) / jobs_per_arrival / total_shape;

    let mut rng = Rng::new(seed);
    let mut pushes: Vec<(u64, Option<u32>)> = Vec::new(); // (second, pull request)
    let mut open_prs: Vec<u32> = (1..=40).collect();
    let mut next_pr = 41;
    for minute in 0..minutes {
        let mut t = minute as f64 * 60.0;
        let rate = shape(minute) * per_shape / 60.0; // per second
        loop {
            t += rng.exp(rate);
            if t >= (minute + 1) as f64 * 60.0 {
                break;
            }
            let second = t as u64;
            if rng.f64() < 0.3 {
                pushes.push((second, None));
                continue;
            }
            if rng.f64() < 0.1 {
                // A new pull request replaces one that was merged or closed.
                let k = rng.range(0, open_prs.len() as u64 - 1) as usize;
                open_prs[k] = next_pr;
                next_pr += 1;
            }
            let pr = open_prs[rng.range(0, open_prs.len() as u64 - 1) as usize];
            pushes.push((second, Some(pr)));
            if rng.f64() < 0.1 {
                let mut at = second;
                for _ in 0..rng.range(1, 3) {
                    at += rng.range(30, 600);
                    pushes.push((at, Some(pr)));
                }
            }
        }
    }
    pushes.sort_unstable();
    let horizon = minutes * 60;
    let mut jobs = Vec::new();
    let mut build_rng = Rng::new(seed ^ 0xb111d);
    for (second, pr) in pushes.into_iter().filter(|(s, _)| *s < horizon) {
        let build = builds.then(|| {
            let duration = build_rng.lognormal(180.0, 0.4).clamp(30.0, 3600.0) as u64;
            let (group, cancel) = match pr {
                Some(n) => (format!("pr{n}-build"), true),
                None => ("main-build".to_string(), false),
            };
            jobs.push(TraceJob {
                id: format!("B{}", jobs.len()),
                submit_s: second,
                duration_s: duration,
                pool: "build".into(),
                gpus: 0,
                group,
                cancel_in_progress: cancel,
                after: Vec::new(),
                step: "build".into(),
            });
            jobs.len() - 1
        });
        let mut add = |pool: &str, gpus: u32, median: f64, sigma: f64, rng: &mut Rng| {
            let after = build.map(|b| vec![jobs[b].id.clone()]).unwrap_or_default();
            let duration = rng.lognormal(median, sigma).clamp(30.0, 4.0 * 3600.0) as u64;
            let (group, cancel) = match pr {
                Some(n) => (format!("pr{n}-{pool}"), true),
                None => (format!("main-{pool}"), false),
            };
            jobs.push(TraceJob {
                id: format!("#{}", jobs.len()),
                submit_s: second,
                duration_s: duration,
                pool: pool.to_string(),
                gpus,
                group,
                cancel_in_progress: cancel,
                after,
                step: String::new(),
            });
        };
        for _ in 0..rng.range(1, 3) {
            add("t4", 1, 420.0, 0.5, &mut rng);
        }
        if rng.f64() < 0.45 {
            for _ in 0..rng.range(1, 2) {
                add("a100", 1, 1200.0, 0.5, &mut rng);
            }
        }
        if rng.f64() < 0.12 {
            add("h100x2", 2, 2400.0, 0.4, &mut rng);
        }
    }
    // Ids in order; `after` follows its build's new id.
    let ids: std::collections::HashMap<String, String> =
        jobs.iter().enumerate().map(|(i, j)| (j.id.clone(), format!("J{:06}", i + 1))).collect();
    for j in &mut jobs {
        j.id = ids.get(&j.id).cloned().unwrap_or_default();
        for a in &mut j.after {
            *a = ids.get(a.as_str()).cloned().unwrap_or_default();
        }
    }
    jobs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipelines_add_a_build_each_push_waits_on_and_keep_the_gpu_jobs() {
        let plain = generate(4, 2, 2_000);
        let piped = pipelines(4, 2, 2_000);
        let gpu: Vec<(u64, u64, &str)> =
            piped.iter().filter(|j| j.gpus > 0).map(|j| (j.submit_s, j.duration_s, j.pool.as_str())).collect();
        assert_eq!(gpu, plain.iter().map(|j| (j.submit_s, j.duration_s, j.pool.as_str())).collect::<Vec<_>>());
        let index: std::collections::HashMap<&str, &TraceJob> = piped.iter().map(|j| (j.id.as_str(), j)).collect();
        for j in piped.iter().filter(|j| j.gpus > 0) {
            let [b] = &j.after[..] else { panic!("{j:?} waits on one build") };
            let b = index[b.as_str()];
            assert_eq!((b.gpus, b.submit_s, b.step.as_str()), (0, j.submit_s, "build"));
        }
        let csv = crate::trace::to_csv(&piped);
        assert_eq!(crate::trace::parse_trace("p.csv", &csv).expect("parses"), piped);
    }

    #[test]
    fn deterministic_and_about_the_size_asked() {
        let a = generate(9, 2, 20_000);
        assert_eq!(a, generate(9, 2, 20_000));
        assert_ne!(a, generate(10, 2, 20_000));
        let n = a.len() as f64;
        assert!((n - 20_000.0).abs() < 20_000.0 * 0.1, "{n}");
        assert!(a.windows(2).all(|w| w[0].submit_s <= w[1].submit_s));
        assert!(a.iter().all(|j| j.submit_s < 2 * 86_400));
        // Daytime is busier than night.
        let at = |h: u64| a.iter().filter(|j| (j.submit_s % 86_400) / 3600 == h).count();
        assert!(at(14) > 3 * at(3), "{} vs {}", at(14), at(3));
    }
}
