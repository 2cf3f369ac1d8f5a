//! The `nvidia-smi` fallback backend, for hosts where NVML cannot be loaded by this process
//! but the tool works (e.g. an unusual library path). The parsing is pure and tested over
//! recorded outputs in `fixtures/`.
//!
//! Limits compared with NVML: no Xid events (`xid_errors` is `None`), MIG memory is derived
//! from the profile name, the slowdown temperature is read only where the driver prints
//! it as an absolute value.

use crate::backend::{BackendKind, GpuBackend, GpuError, GpuProcess, GpuSample, HealthCounters};
use crate::command::{CommandError, CommandOutput, CommandRunner};
use gpuci_core::gpu::{ComputeCapability, GpuInfo, MigInstance, Version};
use gpuci_core::quantity::Bytes;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

pub const INVENTORY_FIELDS: &str =
    "uuid,index,name,memory.total,compute_cap,driver_version,pci.bus_id,persistence_mode,ecc.mode.current,mig.mode.current";
pub const SAMPLE_FIELDS: &str = "utilization.gpu,memory.used,power.draw,temperature.gpu";
pub const HEALTH_FIELDS: &str =
    "memory.used,memory.total,temperature.gpu,retired_pages.sbe,retired_pages.dbe,retired_pages.pending,ecc.errors.uncorrected.volatile.total";
const CSV: &str = "--format=csv,noheader,nounits";

/// `nvidia-smi` through a [`CommandRunner`], each call under `timeout`.
pub struct NvidiaSmi {
    runner: Arc<dyn CommandRunner>,
    timeout: Duration,
}

impl NvidiaSmi {
    pub fn new(runner: Arc<dyn CommandRunner>) -> Self {
        NvidiaSmi { runner, timeout: Duration::from_secs(15) }
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn run(&self, uuid: Option<&str>, args: &[&str]) -> Result<String, GpuError> {
        let not_answering = |detail: String| GpuError::NotAnswering {
            backend: BackendKind::NvidiaSmi,
            uuid: uuid.map(str::to_string),
            detail,
        };
        match self.runner.run("nvidia-smi", args, self.timeout) {
            Ok(out) if out.success() => Ok(out.stdout),
            Ok(out) => Err(not_answering(failure_text(&out))),
            // "nvidia-smi did not answer: command not found" already names the program.
            Err(CommandError::NotFound { .. }) => Err(not_answering("command not found".to_string())),
            Err(e) => Err(not_answering(e.to_string())),
        }
    }

    fn query_one(&self, uuid: &str, fields: &str) -> Result<Vec<Option<String>>, GpuError> {
        let query = format!("--query-gpu={fields}");
        let id = format!("--id={uuid}");
        let out = self.run(Some(uuid), &[&query, CSV, &id])?;
        let line = out
            .lines()
            .find(|l| !l.trim().is_empty())
            .ok_or_else(|| GpuError::UnknownGpu { uuid: uuid.to_string() })?;
        let n = fields.split(',').count();
        Ok(split_row(line, n, "query")?.into_iter().map(|f| f.map(str::to_string)).collect())
    }
}

/// The first lines of what a failed `nvidia-smi` said, for the person reading the reason.
fn failure_text(out: &CommandOutput) -> String {
    let tail = out.tail(3);
    let code = out.status.map_or("a signal".to_string(), |c| format!("exit code {c}"));
    if tail.is_empty() {
        format!("nvidia-smi failed with {code}")
    } else {
        format!("nvidia-smi failed with {code}: {tail}")
    }
}

impl GpuBackend for NvidiaSmi {
    fn kind(&self) -> BackendKind {
        BackendKind::NvidiaSmi
    }

    fn inventory(&self) -> Result<Vec<GpuInfo>, GpuError> {
        let query = format!("--query-gpu={INVENTORY_FIELDS}");
        let mut gpus = parse_inventory(&self.run(None, &[&query, CSV])?)?;
        // CUDA version and minor numbers only appear in the long report; without them the
        // inventory is still usable, so failures here are logged, not returned.
        match self.run(None, &["-q"]) {
            Ok(q) => apply_query_report(&mut gpus, &q),
            Err(e) => {
                tracing::debug!("nvidia-smi -q failed, keeping /dev/nvidia<index> nodes: {e}")
            }
        }
        if gpus.iter().any(|g| g.mig_enabled == Some(true)) {
            match self.run(None, &["-L"]) {
                Ok(l) => {
                    let mut migs = parse_mig_list(&l);
                    for g in &mut gpus {
                        g.mig_instances = migs.remove(&g.uuid).unwrap_or_default();
                    }
                }
                Err(e) => tracing::debug!("nvidia-smi -L failed, MIG instances unknown: {e}"),
            }
        }
        Ok(gpus)
    }

    fn sample(&self, uuid: &str) -> Result<GpuSample, GpuError> {
        let f = self.query_one(uuid, SAMPLE_FIELDS)?;
        sample_from_fields(&f)
    }

    fn processes(&self, uuid: &str) -> Result<Vec<GpuProcess>, GpuError> {
        let out = self.run(Some(uuid), &["--query-compute-apps=gpu_uuid,pid,used_memory", CSV])?;
        Ok(parse_compute_apps(&out)?.into_iter().filter(|(u, _)| u == uuid).map(|(_, p)| p).collect())
    }

    fn health_counters(&self, uuid: &str) -> Result<HealthCounters, GpuError> {
        let f = self.query_one(uuid, HEALTH_FIELDS)?;
        let mut c = health_from_fields(&f)?;
        let id = format!("--id={uuid}");
        match self.run(Some(uuid), &["-q", "-d", "TEMPERATURE", &id]) {
            Ok(t) => c.slowdown_temperature_c = parse_slowdown_temperature(&t),
            Err(e) => tracing::debug!("nvidia-smi -q -d TEMPERATURE failed: {e}"),
        }
        Ok(c)
    }
}

/// A CSV cell, or `None` for the placeholders nvidia-smi prints where a value does not
/// exist (`[N/A]`, `[Not Supported]`, `N/A`, `[Unknown Error]`, ...).
pub fn cell(s: &str) -> Option<&str> {
    let s = s.trim();
    if s.is_empty() || s == "N/A" || (s.starts_with('[') && s.ends_with(']')) {
        None
    } else {
        Some(s)
    }
}

/// Split one `--format=csv,noheader,nounits` row into `n` cells. nvidia-smi does not quote;
/// no field we query can contain a comma.
fn split_row<'a>(line: &'a str, n: usize, what: &'static str) -> Result<Vec<Option<&'a str>>, GpuError> {
    let cells: Vec<Option<&str>> = line.split(',').map(cell).collect();
    if cells.len() != n {
        return Err(GpuError::Parse {
            what,
            line: line.to_string(),
            detail: format!("expected {n} fields, got {}", cells.len()),
        });
    }
    Ok(cells)
}

fn num<T: std::str::FromStr>(
    v: Option<&str>,
    field: &str,
    line: &str,
    what: &'static str,
) -> Result<Option<T>, GpuError> {
    v.map(|s| {
        s.parse::<T>().map_err(|_| GpuError::Parse {
            what,
            line: line.to_string(),
            detail: format!("{field} {s:?} is not a number"),
        })
    })
    .transpose()
}

fn required<T>(v: Option<T>, field: &str, line: &str, what: &'static str) -> Result<T, GpuError> {
    v.ok_or_else(|| GpuError::Parse { what, line: line.to_string(), detail: format!("{field} is missing") })
}

fn enabled(v: Option<&str>) -> Option<bool> {
    match v?.to_ascii_lowercase().as_str() {
        "enabled" | "yes" | "on" => Some(true),
        "disabled" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Parse `--query-gpu=INVENTORY_FIELDS`. Device nodes default to `/dev/nvidia{index}` until
/// [`apply_query_report`] supplies the real minor numbers.
pub fn parse_inventory(csv: &str) -> Result<Vec<GpuInfo>, GpuError> {
    const W: &str = "inventory";
    let mut gpus = Vec::new();
    for line in csv.lines().filter(|l| !l.trim().is_empty()) {
        let c = split_row(line, 10, W)?;
        let uuid = required(c[0], "uuid", line, W)?.to_string();
        let index: u32 = required(num(c[1], "index", line, W)?, "index", line, W)?;
        let cc = required(c[4], "compute_cap", line, W)?;
        let compute_capability = cc
            .split_once('.')
            .and_then(|(a, b)| Some(ComputeCapability { major: a.parse().ok()?, minor: b.parse().ok()? }))
            .ok_or_else(|| GpuError::Parse {
                what: W,
                line: line.to_string(),
                detail: format!("compute_cap {cc:?}"),
            })?;
        let driver = required(c[5], "driver_version", line, W)?;
        gpus.push(GpuInfo {
            uuid,
            index,
            name: required(c[2], "name", line, W)?.to_string(),
            memory: Bytes::from_mib(required(num(c[3], "memory.total", line, W)?, "memory.total", line, W)?),
            compute_capability,
            driver_version: Version::parse(driver).ok_or_else(|| GpuError::Parse {
                what: W,
                line: line.to_string(),
                detail: format!("driver_version {driver:?}"),
            })?,
            cuda_driver_version: None,
            mig_enabled: enabled(c[9]),
            mig_instances: Vec::new(),
            ecc_enabled: enabled(c[8]),
            persistence_mode: enabled(c[7]),
            pci_bus_id: c[6].unwrap_or_default().to_string(),
            device_node: format!("/dev/nvidia{index}"),
            simulated: false,
        });
    }
    Ok(gpus)
}

/// `key : value` lines of `nvidia-smi -q`, with the indentation removed.
fn report_value<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let (k, v) = line.split_once(':')?;
    (k.trim() == key).then(|| v.trim())
}

/// Fill in the CUDA version (`CUDA Version : 12.4`) and device nodes (`Minor Number : 4`,
/// under the `GPU 00000000:18:00.0` header of each GPU) from `nvidia-smi -q`.
pub fn apply_query_report(gpus: &mut [GpuInfo], report: &str) {
    let mut current_bus: Option<String> = None;
    for line in report.lines() {
        if let Some(bus) = line.strip_prefix("GPU ") {
            current_bus = Some(bus.trim().to_ascii_lowercase());
        } else if let Some(v) = report_value(line, "CUDA Version").and_then(Version::parse) {
            for g in gpus.iter_mut() {
                g.cuda_driver_version = Some(v.clone());
            }
        } else if let Some(minor) = report_value(line, "Minor Number").and_then(|v| v.parse::<u32>().ok()) {
            let bus = current_bus.as_deref().unwrap_or_default();
            if let Some(g) = gpus.iter_mut().find(|g| g.pci_bus_id.to_ascii_lowercase() == bus) {
                g.device_node = format!("/dev/nvidia{minor}");
            }
        }
    }
}

/// MIG instances per parent GPU UUID from `nvidia-smi -L`. Memory comes from the profile
/// name (`3g.20gb` → 20 GB, counted as 20·10⁹ bytes so it never overstates what the slice
/// has).
pub fn parse_mig_list(text: &str) -> HashMap<String, Vec<MigInstance>> {
    let uuid_in =
        |l: &str| l.split_once("(UUID: ").and_then(|(_, r)| r.split(')').next()).map(|u| u.trim().to_string());
    let mut out: HashMap<String, Vec<MigInstance>> = HashMap::new();
    let mut parent: Option<String> = None;
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("GPU ") {
            parent = uuid_in(t);
        } else if let (Some(rest), Some(p)) = (t.strip_prefix("MIG "), &parent) {
            let profile = rest.split_whitespace().next().unwrap_or_default().to_string();
            if let Some(uuid) = uuid_in(t) {
                out.entry(p.clone()).or_default().push(MigInstance {
                    memory: mig_profile_memory(&profile),
                    uuid,
                    profile,
                });
            }
        }
    }
    out
}

/// `1g.10gb` → 10 GB; `1g.10gb+me` → 10 GB; unknown shapes → 0.
pub fn mig_profile_memory(profile: &str) -> Bytes {
    let gb = profile
        .split_once('.')
        .map(|(_, m)| m.chars().take_while(char::is_ascii_digit).collect::<String>())
        .and_then(|d| d.parse::<u64>().ok())
        .unwrap_or(0);
    Bytes(gb * 1_000_000_000)
}

fn sample_from_fields(f: &[Option<String>]) -> Result<GpuSample, GpuError> {
    const W: &str = "sample";
    let line = f.iter().map(|c| c.as_deref().unwrap_or("[N/A]")).collect::<Vec<_>>().join(", ");
    let get = |i: usize| f.get(i).and_then(|c| c.as_deref());
    Ok(GpuSample {
        utilization_pct: num(get(0), "utilization.gpu", &line, W)?,
        memory_used: Bytes::from_mib(num(get(1), "memory.used", &line, W)?.unwrap_or(0)),
        power_watts: num(get(2), "power.draw", &line, W)?,
        temperature_c: num(get(3), "temperature.gpu", &line, W)?,
    })
}

/// Parse one `--query-gpu=SAMPLE_FIELDS` row.
pub fn parse_sample(line: &str) -> Result<GpuSample, GpuError> {
    let f: Vec<Option<String>> = split_row(line, 4, "sample")?.into_iter().map(|c| c.map(str::to_string)).collect();
    sample_from_fields(&f)
}

fn health_from_fields(f: &[Option<String>]) -> Result<HealthCounters, GpuError> {
    const W: &str = "health";
    let line = f.iter().map(|c| c.as_deref().unwrap_or("[N/A]")).collect::<Vec<_>>().join(", ");
    let get = |i: usize| f.get(i).and_then(|c| c.as_deref());
    let sbe: Option<u64> = num(get(3), "retired_pages.sbe", &line, W)?;
    let dbe: Option<u64> = num(get(4), "retired_pages.dbe", &line, W)?;
    Ok(HealthCounters {
        xid_errors: None,
        last_xid: None,
        retired_pages: match (sbe, dbe) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
        },
        retired_pages_pending: enabled(get(5)),
        ecc_uncorrectable_volatile: num(get(6), "ecc.errors.uncorrected.volatile.total", &line, W)?,
        temperature_c: num(get(2), "temperature.gpu", &line, W)?,
        slowdown_temperature_c: None,
        memory_used: Bytes::from_mib(num(get(0), "memory.used", &line, W)?.unwrap_or(0)),
        memory_total: Bytes::from_mib(num(get(1), "memory.total", &line, W)?.unwrap_or(0)),
    })
}

/// Parse one `--query-gpu=HEALTH_FIELDS` row (the slowdown temperature comes separately).
pub fn parse_health(line: &str) -> Result<HealthCounters, GpuError> {
    let f: Vec<Option<String>> = split_row(line, 7, "health")?.into_iter().map(|c| c.map(str::to_string)).collect();
    health_from_fields(&f)
}

/// `(gpu_uuid, process)` rows of `--query-compute-apps=gpu_uuid,pid,used_memory`.
pub fn parse_compute_apps(csv: &str) -> Result<Vec<(String, GpuProcess)>, GpuError> {
    const W: &str = "compute apps";
    let mut out = Vec::new();
    for line in csv.lines().filter(|l| !l.trim().is_empty()) {
        // Some driver versions print this sentence instead of an empty table.
        if line.trim_start().starts_with("No running") {
            continue;
        }
        let c = split_row(line, 3, W)?;
        let uuid = required(c[0], "gpu_uuid", line, W)?.to_string();
        let pid: u32 = required(num(c[1], "pid", line, W)?, "pid", line, W)?;
        let used: Option<u64> = num(c[2], "used_memory", line, W)?;
        out.push((uuid, GpuProcess { pid, used_memory: used.map(Bytes::from_mib) }));
    }
    Ok(out)
}

/// The absolute slowdown temperature from `nvidia-smi -q -d TEMPERATURE`
/// (`GPU Slowdown Temp : 89 C`). Newer drivers print only margins (`GPU Slowdown T.Limit
/// Temp : -2 C`), which are not absolute; then this returns `None` and the health policy's
/// fallback limit applies.
pub fn parse_slowdown_temperature(report: &str) -> Option<u32> {
    report
        .lines()
        .find_map(|l| report_value(l, "GPU Slowdown Temp"))
        .and_then(|v| v.trim_end_matches('C').trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::FakeRunner;

    const H100_CSV: &str = include_str!("../fixtures/h100-query-gpu.csv");
    const A100_CSV: &str = include_str!("../fixtures/a100-mig-query-gpu.csv");
    const H100_Q: &str = include_str!("../fixtures/h100-q.txt");
    const A100_L: &str = include_str!("../fixtures/a100-mig-L.txt");
    const APPS: &str = include_str!("../fixtures/compute-apps.csv");
    const H100_TEMP: &str = include_str!("../fixtures/h100-q-temperature.txt");
    const A100_TEMP: &str = include_str!("../fixtures/a100-q-temperature.txt");
    const CRASHED: &str = include_str!("../fixtures/crashed-driver.txt");

    #[test]
    fn parses_h100_inventory_and_report() {
        let mut gpus = parse_inventory(H100_CSV).unwrap();
        assert_eq!(gpus.len(), 4);
        let g = &gpus[0];
        assert_eq!(g.name, "NVIDIA H100 80GB HBM3");
        assert_eq!(g.memory.mib(), 81_559);
        assert_eq!(g.compute_capability, ComputeCapability { major: 9, minor: 0 });
        assert_eq!(g.driver_version, Version::new(vec![550, 54, 15]));
        assert_eq!((g.persistence_mode, g.ecc_enabled, g.mig_enabled), (Some(true), Some(true), Some(false)));
        assert_eq!(gpus[2].persistence_mode, Some(false));
        assert!(!g.simulated);
        assert_eq!(gpus[1].device_node, "/dev/nvidia1");

        apply_query_report(&mut gpus, H100_Q);
        assert_eq!(gpus[0].cuda_driver_version, Some(Version::new(vec![12, 4])));
        // Minor numbers differ from indices on this host: the device node must follow them.
        assert_eq!(gpus[0].device_node, "/dev/nvidia4");
        assert_eq!(gpus[3].device_node, "/dev/nvidia7");
    }

    #[test]
    fn parses_a100_with_mig_and_na_fields() {
        let gpus = parse_inventory(A100_CSV).unwrap();
        assert_eq!(gpus[0].mig_enabled, Some(true));
        assert_eq!((gpus[1].ecc_enabled, gpus[1].mig_enabled), (None, None));
        let migs = parse_mig_list(A100_L);
        let m = &migs["GPU-8f1d2e3a-4b5c-6d7e-8f90-a1b2c3d4e5f6"];
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].profile, "3g.20gb");
        assert_eq!(m[0].uuid, "MIG-1a2b3c4d-5e6f-5a7b-8c9d-0e1f2a3b4c5d");
        assert_eq!(m[1].memory, Bytes(5_000_000_000));
        assert!(!migs.contains_key("GPU-9a2e3f4b-5c6d-7e8f-90a1-b2c3d4e5f6a7"));
        assert_eq!(mig_profile_memory("1g.10gb+me"), Bytes(10_000_000_000));
    }

    #[test]
    fn rejects_malformed_rows_with_the_line() {
        let e = parse_inventory("GPU-x, 0, NVIDIA H100, 81559").unwrap_err().to_string();
        assert!(e.contains("expected 10 fields, got 4") && e.contains("GPU-x"), "{e}");
        let e = parse_inventory("GPU-x, 0, NVIDIA H100, lots, 9.0, 550.54.15, 0:1:0.0, Enabled, Enabled, Disabled")
            .unwrap_err();
        assert!(e.to_string().contains("memory.total \"lots\""), "{e}");
    }

    #[test]
    fn parses_samples_with_missing_sensors() {
        let s = parse_sample("87, 40231, 612.44, 61").unwrap();
        assert_eq!((s.utilization_pct, s.memory_used.mib(), s.temperature_c), (Some(87), 40231, Some(61)));
        assert_eq!(s.power_watts, Some(612.44));
        let s = parse_sample("[N/A], 0, [Not Supported], 30").unwrap();
        assert_eq!((s.utilization_pct, s.power_watts), (None, None));
    }

    #[test]
    fn parses_health_rows_for_hopper_and_ampere() {
        // H100: page retirement is replaced by row remapping, so the fields are N/A.
        let h = parse_health("4, 81559, 33, [N/A], [N/A], [N/A], 0").unwrap();
        assert_eq!((h.retired_pages, h.retired_pages_pending, h.ecc_uncorrectable_volatile), (None, None, Some(0)));
        assert_eq!(h.xid_errors, None);
        let a = parse_health("0, 40960, 30, 2, 1, Yes, 3").unwrap();
        assert_eq!(
            (a.retired_pages, a.retired_pages_pending, a.ecc_uncorrectable_volatile),
            (Some(3), Some(true), Some(3))
        );
        assert_eq!(parse_slowdown_temperature(A100_TEMP), Some(89));
        assert_eq!(parse_slowdown_temperature(H100_TEMP), None);
    }

    #[test]
    fn parses_compute_apps() {
        let apps = parse_compute_apps(APPS).unwrap();
        assert_eq!(apps.len(), 3);
        assert_eq!(apps[0].1, GpuProcess { pid: 18231, used_memory: Some(Bytes::from_mib(40231)) });
        assert_eq!(apps[2].1.used_memory, None);
        assert!(parse_compute_apps("").unwrap().is_empty());
        assert!(parse_compute_apps("No running processes found\n").unwrap().is_empty());
    }

    #[test]
    fn backend_runs_the_documented_commands() {
        let r = Arc::new(FakeRunner::new());
        r.on(&format!("nvidia-smi --query-gpu={INVENTORY_FIELDS} {CSV}"), Ok(CommandOutput::ok(A100_CSV)))
            .on("nvidia-smi -q", Ok(CommandOutput::ok(H100_Q)))
            .on("nvidia-smi -L", Ok(CommandOutput::ok(A100_L)))
            .on(
                &format!("nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory {CSV}"),
                Ok(CommandOutput::ok(APPS)),
            );
        let smi = NvidiaSmi::new(r.clone());
        let inv = smi.inventory().unwrap();
        assert_eq!(inv[0].mig_instances.len(), 3);
        assert_eq!(inv[0].cuda_driver_version, Some(Version::new(vec![12, 4])));
        let procs = smi.processes("GPU-4c2a7b3d-0e5f-8a21-9b3c-6d7e8f9a0b12").unwrap();
        assert_eq!(procs, vec![GpuProcess { pid: 19002, used_memory: None }]);
    }

    #[test]
    fn crashed_driver_is_not_answering_with_the_message() {
        let r = Arc::new(FakeRunner::new());
        r.on("nvidia-smi", Ok(CommandOutput::failed(9, CRASHED, "")));
        let e = NvidiaSmi::new(r).inventory().unwrap_err();
        assert!(e.is_transient());
        let text = e.to_string();
        assert!(text.contains("exit code 9") && text.contains("couldn't communicate with the NVIDIA driver"), "{text}");
    }
}
