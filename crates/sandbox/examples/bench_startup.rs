//! Sandbox start-up overhead over a bare process spawn.
//!
//! `cargo run --release -p gpuci-sandbox --example bench_startup -- [runs]` (root; bwrap and
//! writable cgroups for the sandboxed rows). Each run starts `true` and waits for it; the
//! sandboxed rows also time `cleanup` (kill check + cgroup removal) separately.
//!
//! Last numbers (2-core VM, load ~4, `nice -n -20`, 150 rounds; BENCHMARKS.md "Sandbox start-up"):
//! Bubblewrap + cgroup median 11.11 ms before the `/etc` view, 8.00 ms after (bare spawn 0.73 ms);
//! in a busier pair 23.60 → 22.17 ms (p90 34.89 → 27.47 ms). On cgroup v1 the first `cgroup.procs`
//! write can add one RCU grace period (12–16 ms) unless the host set `favordynmods`.

use std::time::{Duration, Instant};

use gpuci_sandbox::{detect, CgroupUse, Isolation, Sandbox, SandboxSpec};
use tokio::io::AsyncReadExt;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn p90(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() * 9 / 10]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let runs: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(200);
    let caps = detect();
    eprintln!("{caps:?}");
    let ws = tempfile::Builder::new().prefix("gpuci-bench-").tempdir_in("/var/tmp").expect("tempdir");

    // Interleaved: every round times each variant once, so all see the same machine load.
    let rows = [
        ("Isolation::None + cgroup", Isolation::None, CgroupUse::Required),
        ("Bubblewrap + cgroup", Isolation::Bubblewrap, CgroupUse::Required),
        ("Bubblewrap, no cgroup", Isolation::Bubblewrap, CgroupUse::Disabled),
    ];
    let mut bare = Vec::new();
    let mut start = vec![Vec::new(); rows.len()];
    let mut clean = vec![Vec::new(); rows.len()];
    for i in 0..runs {
        let t = Instant::now();
        let status = tokio::process::Command::new("/usr/bin/true").status().await.expect("true");
        assert!(status.success());
        bare.push(t.elapsed());
        for (r, (name, isolation, cgroups)) in rows.iter().enumerate() {
            let mut spec = SandboxSpec::new(format!("bench-{r}-{i}"), ws.path(), vec!["true".into()]);
            spec.env.insert("PATH".into(), "/usr/bin:/bin".into());
            spec.isolation = *isolation;
            spec.cgroups = *cgroups;
            spec.resources.memory = Some(gpuci_core::quantity::Bytes::from_mib(512));
            spec.resources.pids = Some(256);
            let t = Instant::now();
            let (mut sb, mut so, _se) = match Sandbox::spawn(&spec) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("{name}: {e}");
                    continue;
                }
            };
            let mut sink = Vec::new();
            let _ = so.read_to_end(&mut sink).await;
            let exit = sb.wait().await.expect("wait");
            assert!(exit.success(), "{name}: {exit}");
            start[r].push(t.elapsed());
            let t = Instant::now();
            sb.cleanup().await.expect("cleanup");
            clean[r].push(t.elapsed());
        }
    }
    let bare_median = median(bare.clone());
    println!("runs: {runs}, interleaved");
    println!("{:<34} median {:>9}  p90 {:>9}", "bare spawn+wait of true", ms(bare_median), ms(p90(bare)));
    for (r, (name, _, _)) in rows.iter().enumerate() {
        if start[r].is_empty() {
            println!("{name}: skipped");
            continue;
        }
        let m = median(start[r].clone());
        println!(
            "{:<34} median {:>9}  p90 {:>9}  overhead {:>9}  cleanup median {:>9}",
            name,
            ms(m),
            ms(p90(start[r].clone())),
            ms(m.saturating_sub(bare_median)),
            ms(median(clean[r].clone()))
        );
    }
}
