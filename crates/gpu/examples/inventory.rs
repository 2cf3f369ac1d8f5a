//! Print what gpuci sees on this host: the detected inventory, one sample, health counters
//! and a pre-job check of each GPU as JSON on stdout, a short telemetry run, then the doctor
//! table on stderr.
//!
//! ```text
//! cargo run -p gpuci-gpu --example inventory                       # real GPUs (NVML → nvidia-smi)
//! cargo run -p gpuci-gpu --example inventory -- --simulate 2xH100  # simulated
//! cargo run -p gpuci-gpu --example inventory -- --min-driver 550 --min-cuda 12.4 --seconds 5
//! ```

use gpuci_core::gpu::Version;
use gpuci_gpu::{
    detect, doctor, doctor_passed, format_table, pre_job_check, sample_loop, DetectOptions, DoctorOptions,
    HealthBaseline, HealthPolicy, SystemRunner,
};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let host =
        std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "localhost".into());
    let mut detect_opts = DetectOptions::new(host);
    let mut doctor_opts = DoctorOptions::default();
    let mut seconds = 2u64;
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--simulate" => detect_opts.simulate = Some(value()?),
            "--min-driver" => doctor_opts.min_driver = Some(Version::parse(&value()?).ok_or("bad --min-driver")?),
            "--min-cuda" => doctor_opts.min_cuda = Some(Version::parse(&value()?).ok_or("bad --min-cuda")?),
            "--seconds" => seconds = value()?.parse()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }

    let detection = detect(&detect_opts)?;
    let backend = detection.backend.clone();
    let gpus = backend.inventory()?;
    let mut per_gpu = Vec::new();
    for g in &gpus {
        let result = |r: Result<serde_json::Value, gpuci_gpu::GpuError>| {
            r.unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }))
        };
        let baseline = HealthBaseline::capture(backend.as_ref(), &g.uuid);
        per_gpu.push(serde_json::json!({
            "uuid": g.uuid,
            "sample": result(backend.sample(&g.uuid).map(|s| serde_json::to_value(s).unwrap_or_default())),
            "processes": result(backend.processes(&g.uuid).map(|p| serde_json::to_value(p).unwrap_or_default())),
            "health_counters": result(backend.health_counters(&g.uuid).map(|c| serde_json::to_value(c).unwrap_or_default())),
            "pre_job_check": match &baseline {
                Ok(b) => serde_json::to_value(pre_job_check(backend.as_ref(), &g.uuid, b, &HealthPolicy::default()))?,
                Err(e) => serde_json::json!({ "error": e.to_string() }),
            },
        }));
    }

    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        stop.cancel();
    });
    let uuids = gpus.iter().map(|g| g.uuid.clone()).collect();
    let telemetry = sample_loop(backend.clone(), uuids, Duration::from_millis(500), cancel, |_, _, _| {}).await;

    let report = serde_json::json!({
        "backend": detection.kind(),
        "fallback_reasons": detection.fallback_reasons,
        "inventory": gpus,
        "gpus": per_gpu,
        "telemetry": telemetry,
    });
    println!("{}", serde_json::to_string_pretty(&report)?);

    let checks = doctor(&doctor_opts, &detection, &SystemRunner);
    eprint!("{}", format_table(&checks));
    eprintln!("doctor: {}", if doctor_passed(&checks) { "passed" } else { "FAILED" });
    Ok(())
}
