//! Masking throughput on one core: 20 secrets of 20–39 characters (each with its base64 at
//! three offsets in two alphabets, hex and the rest: ~360 strings searched for), and a 64 KiB
//! line of training-log text that holds none of them — the common case, every line of every
//! job pays it. Also a line with a `%` (searched percent-decoded as well) and the time to
//! build a job's masker.
//!
//! Run: `cargo bench -p gpuci-core --bench mask` (release profile). Deterministic input;
//! only the timings vary.

use gpuci_core::mask::Masker;
use std::hint::black_box;
use std::time::Instant;

fn main() {
    let secrets: Vec<String> =
        (0..20).map(|i| format!("tok_{i:02}_{}", &"Zq9xW3kLmN8pR2tV5yB7cD1fG4hJ6aS0dF"[..14 + i])).collect();
    let mut line = String::new();
    let mut n = 0u64;
    while line.len() < 64 * 1024 {
        n = n.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        line.push_str(&format!("step {} loss={:.4} lr=3e-4 ", n % 1000, (n >> 40) as f64 / 1e7));
    }
    line.truncate(64 * 1024);
    let t = Instant::now();
    let m = Masker::new(secrets.iter().map(String::as_str));
    let build = t.elapsed();
    let percent = format!("{}%2F", &line[..line.len() - 3]);
    for (name, text) in [("64 KiB line", &line), ("64 KiB line with a '%'", &percent)] {
        let iters = 500;
        let t = Instant::now();
        for _ in 0..iters {
            black_box(m.mask(black_box(text)));
        }
        let per = t.elapsed() / iters;
        println!("{name}: {:.0} µs per line, {:.0} MiB/s", per.as_secs_f64() * 1e6, 64.0 / 1024.0 / per.as_secs_f64());
    }
    println!("Masker::new with 20 secrets: {:.1} ms", build.as_secs_f64() * 1e3);
}
