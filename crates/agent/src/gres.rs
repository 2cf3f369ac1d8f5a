//! Which GPU device files a Slurm job was granted (`gpuci agent --allocation slurm`).
//!
//! Slurm names a job's GPUs by their **GRES index**: the position of the GPU in the node's
//! GRES device list, not the device's minor number. With `File=/dev/nvidia[4-7]` a job
//! granted `/dev/nvidia4` sees `SLURM_JOB_GPUS=0`; with `File=/dev/nvidia[0,2,3]` (a broken
//! GPU taken out of service) index 1 is `/dev/nvidia2`. Reading the index as a minor number
//! serves a GPU Slurm gave nobody, or somebody else. This module maps indices through the
//! node's ordered list, and refuses — with the reason — wherever the list is not certain.
//!
//! What the variables mean (Slurm 22.05 `gres_common.c`, `common_gres_set_env`,
//! `gres_common_gpu_set_env`; the release the tests run):
//! - `SLURM_JOB_GPUS` (batch script, prolog) / `SLURM_STEP_GPUS` (a step): GRES indices.
//! - `CUDA_VISIBLE_DEVICES`, `GPU_DEVICE_ORDINAL` (and `ROCR_VISIBLE_DEVICES`): the same GRES
//!   indices, except with `TaskPlugin=task/cgroup` + `ConstrainDevices=yes`, where they are
//!   renumbered 0..n-1 (the GPUs the job can see), or a MIG UUID when AutoDetect found one.
//!   Never a minor number either; this module does not read them.
//!
//! How Slurm orders the node's list (checked against Slurm 22.05's source and, where marked,
//! against the test cluster of `crates/cli/tests/fleets_slurm.rs`):
//! - Every `Name=gpu` line of gres.conf that applies to the node (`NodeName=` hostlist, or no
//!   `NodeName=`) contributes its `File=` hostlist, expanded in the order written
//!   (`common_node_config_load`: one index per file).
//! - Lines are taken per type **in the order of the node's `Gres=` in slurm.conf**, and in
//!   file order within a type (`gres.c`, `_merge_config` → `_merge_gres2`, which matches
//!   types case-insensitively). So `Gres=gpu:h100:2,gpu:a100:2` with an `a100` line written
//!   first still puts the h100 files at indices 0-1 (test cluster: confirmed). An untyped
//!   `Gres=gpu:N` takes the lines in file order.
//! - With `AutoDetect=nvml|rsmi|...` for the node, slurmd re-sorts the list by device file and
//!   then by NVML's link matrix (PCI bus order) (`gres_gpu.c`, `_normalize_gres_conf`): an
//!   order gres.conf does not show. gres.conf(5): "the minor number assigned by the OS ...
//!   is not necessarily the same as the device number/index".
//!
//! Sources, and which wins:
//! 1. The indices: `scontrol -d show job $SLURM_JOB_ID` (`GRES=gpu:2(IDX:0-1)` on this
//!    node's line) is what slurmctld allocated; `SLURM_JOB_GPUS`/`SLURM_STEP_GPUS` is what
//!    slurmstepd set from the same bitmap. Each may be missing; where both speak the
//!    variable's indices must be among scontrol's (a step may hold a part of the job), and
//!    the variable's are used.
//! 2. The device files: gres.conf + slurm.conf beside `$SLURM_CONF`, as above.
//! 3. The job's device cgroup (`ConstrainDevices=yes`): which of the node's GPU device files
//!    this process may open — Slurm's own enforcement, the strongest fact there is. Where
//!    the cgroup constrains (some GPU files refused with EPERM), the mapped files must be
//!    exactly the ones it lets through, or the agent refuses to start; where gres.conf cannot
//!    be read or ordered, the files the cgroup lets through are the grant if their number is
//!    the number of indices. What it cannot catch: slurmd only fences the files in its own
//!    list, so a gres.conf that maps an index to a file slurmd does not manage at all (a GPU
//!    left out of every line) looks the same as a granted one (seen on the test cluster).
//!
//! Anything else — no node name, an unreadable gres.conf with no constraining cgroup, an
//! index past the list, `MultipleFiles=` (MIG), a count that disagrees with slurm.conf, two
//! sources that disagree — is refused, never guessed: an agent that guessed would hand out a
//! GPU Slurm gave somebody else.

use crate::allocation::parse_index_list;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why the agent cannot tell which GPUs its Slurm job was granted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GresError {
    #[error("{what} {expr:?}: {detail}")]
    List { what: &'static str, expr: String, detail: String },
    #[error("{file}:{line}: {detail}")]
    Conf { file: String, line: usize, detail: String },
    #[error("cannot read {file}: {detail}")]
    Unreadable { file: String, detail: String },
    #[error(
        "Slurm granted {on_node} GPU(s) but did not say which (neither SLURM_JOB_GPUS nor `scontrol -d show job {job}` names GRES indices): \
         the node's gres.conf needs File= lines (or AutoDetect) so GPUs have indices"
    )]
    NoIndices { job: String, on_node: u32 },
    #[error("the job's GPUs are named twice, differently: {env_var}={env:?}, `scontrol -d show job {job}` says IDX {scontrol:?} on node {node}")]
    IndicesDisagree { job: String, node: String, env_var: &'static str, env: Vec<u32>, scontrol: Vec<u32> },
    #[error("SLURMD_NODENAME is not set, and gres.conf has NodeName= lines: cannot tell which lines are this node's")]
    NoNodeName,
    #[error(
        "{file}: AutoDetect={mechanism} applies to node {node}: slurmd then numbers GPUs in PCI bus order, which gres.conf does not show; \
         with ConstrainDevices=yes (task/cgroup) the agent reads the grant from the job's device cgroup instead"
    )]
    AutoDetect { file: String, node: String, mechanism: String },
    #[error(
        "{file}: no Name=gpu line with File= applies to node {node}: the GPUs have no device files to map indices to"
    )]
    NoGpuLines { file: String, node: String },
    #[error("{file}:{line}: {detail}")]
    Unsupported { file: String, line: usize, detail: String },
    #[error("{detail} (node {node}): Slurm would truncate or pad the list; fix gres.conf or slurm.conf so they agree")]
    CountMismatch { node: String, detail: String },
    #[error(
        "gres.conf gives several GPU types ({types}) and slurm.conf's Gres= for node {node} cannot be read ({why}): \
         Slurm orders the types as slurm.conf lists them"
    )]
    TypeOrderUnknown { node: String, types: String, why: String },
    #[error("GRES index {index} is past the node's {len} GPU device file(s) ({files})")]
    IndexOutOfRange { index: u32, len: usize, files: String },
    #[error("{file} is not an NVIDIA device file (/dev/nvidiaN): gpuci serves NVIDIA GPUs by minor number")]
    NotNvidia { file: String },
    #[error(
        "the job's device cgroup lets it open {allowed:?}, but gres.conf maps its GRES indices {indices:?} to {mapped:?}: \
         the gres.conf this agent read is not the one slurmd uses"
    )]
    CgroupDisagrees { indices: Vec<u32>, mapped: Vec<String>, allowed: Vec<String> },
    #[error("{0}; and the job's device cgroup does not say which GPUs it may open (ConstrainDevices=yes would)")]
    NoMapping(Box<GresError>),
    #[error(
        "Slurm granted {} GPU(s) on this node (GRES indices {indices:?}: {files:?}), the fleet's machines have {expect} \
         (--expect-gpus): is Slurm giving the GPUs it was asked for?",
        files.len()
    )]
    UnexpectedCount { indices: Vec<u32>, files: Vec<String>, expect: u32 },
}

/// Expands a Slurm hostlist expression: `/dev/nvidia[0-3,5]`, `tux[00-15]`, `a,b[1-2]`,
/// `rack[1-2]node[1-2]` (each bracket multiplies). Order is kept as written; zero padding
/// is kept from the range's lower bound (`[08-10]` → `08, 09, 10`), as Slurm does.
pub fn expand_hostlist(expr: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for item in split_outside(expr, ',', '[', ']') {
        let item = item.trim();
        if item.is_empty() {
            return Err("an empty entry".into());
        }
        expand_item(item, &mut out)?;
        if out.len() > 65_536 {
            return Err("more than 65536 names".into());
        }
    }
    Ok(out)
}

fn expand_item(item: &str, out: &mut Vec<String>) -> Result<(), String> {
    let Some(open) = item.find('[') else {
        if item.contains(']') {
            return Err(format!("{item:?}: a ']' without '['"));
        }
        out.push(item.to_string());
        return Ok(());
    };
    let close = item[open..].find(']').map(|c| open + c).ok_or_else(|| format!("{item:?}: '[' is not closed"))?;
    let (prefix, ranges, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let mut tails = Vec::new();
    expand_item_or_empty(rest, &mut tails)?;
    for range in ranges.split(',') {
        let range = range.trim();
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let bad = || format!("{range:?} is not a number or a range of numbers");
        if lo.is_empty() || !lo.bytes().all(|b| b.is_ascii_digit()) || !hi.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let (a, b) = (lo.parse::<u64>().map_err(|_| bad())?, hi.parse::<u64>().map_err(|_| bad())?);
        if b < a || b - a > 65_536 {
            return Err(format!("{range:?} is not a range of numbers"));
        }
        let width = if lo.len() > 1 && lo.starts_with('0') { lo.len() } else { 0 };
        for n in a..=b {
            for t in &tails {
                out.push(format!("{prefix}{n:0width$}{t}"));
            }
        }
    }
    Ok(())
}

fn expand_item_or_empty(rest: &str, out: &mut Vec<String>) -> Result<(), String> {
    if rest.is_empty() {
        out.push(String::new());
        Ok(())
    } else {
        expand_item(rest, out)
    }
}

/// Splits at `sep` where not inside `open`…`close` (`gpu:1(IDX:0,2),gpu:2(IDX:3-4)`).
fn split_outside(s: &str, sep: char, open: char, close: char) -> Vec<&str> {
    let (mut depth, mut start, mut out) = (0i32, 0usize, Vec::new());
    for (i, c) in s.char_indices() {
        if c == open {
            depth += 1;
        } else if c == close {
            depth -= 1;
        } else if c == sep && depth == 0 {
            out.push(&s[start..i]);
            start = i + c.len_utf8();
        }
    }
    out.push(&s[start..]);
    out
}

/// The `key=value` words of a Slurm config line (keys lower-cased), after `#` comments.
fn words(line: &str) -> Vec<(String, String)> {
    let line = line.split('#').next().unwrap_or("");
    line.split_whitespace()
        .map(|w| match w.split_once('=') {
            Some((k, v)) => (k.to_ascii_lowercase(), v.trim_matches('"').to_string()),
            None => (w.to_ascii_lowercase(), String::new()),
        })
        .collect()
}

/// Config lines joined where one ends in `\`, each with its first line number.
fn logical_lines(text: &str) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let (n, mut acc) = pending.take().unwrap_or((i + 1, String::new()));
        match raw.strip_suffix('\\') {
            Some(head) => {
                acc.push_str(head);
                acc.push(' ');
                pending = Some((n, acc));
            }
            None => {
                acc.push_str(raw);
                out.push((n, acc));
            }
        }
    }
    out.extend(pending);
    out
}

fn names_node(hostlist: &str, node: &str) -> Result<bool, String> {
    Ok(expand_hostlist(hostlist)?.iter().any(|h| h == node))
}

/// One `Name=gpu` line of gres.conf that applies to the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuLine {
    pub line: usize,
    pub type_name: Option<String>,
    pub files: Vec<String>,
}

/// What gres.conf says about the node's GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GresConf {
    pub file: String,
    pub lines: Vec<GpuLine>,
    /// The AutoDetect mechanism in force for the node, if not `off`.
    pub autodetect: Option<String>,
}

/// Parses gres.conf (`file` names it in errors) for node `node` (`SLURMD_NODENAME`).
pub fn parse_gres_conf(file: &str, text: &str, node: Option<&str>) -> Result<GresConf, GresError> {
    let (mut lines, mut global_auto, mut node_auto) = (Vec::new(), None, None);
    let conf_err = |line: usize, detail: String| GresError::Conf { file: file.into(), line, detail };
    for (n, l) in logical_lines(text) {
        let w = words(&l);
        if w.is_empty() {
            continue;
        }
        let get = |k: &str| w.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
        let for_node = match get("nodename") {
            None => None,
            Some(hl) => {
                let node = node.ok_or(GresError::NoNodeName)?;
                Some(names_node(hl, node).map_err(|e| conf_err(n, format!("NodeName={hl}: {e}")))?)
            }
        };
        if for_node == Some(false) {
            continue;
        }
        if let Some(a) = get("autodetect") {
            let a = a.to_ascii_lowercase();
            if for_node == Some(true) {
                node_auto = Some(a);
            } else {
                global_auto = Some(a);
            }
        }
        let Some(name) = get("name") else { continue };
        // `mps` and `shard` lines name GPUs too, but their own GRES, with indices of their own.
        if !name.eq_ignore_ascii_case("gpu") {
            continue;
        }
        if get("multiplefiles").is_some() {
            return Err(GresError::Unsupported {
                file: file.into(),
                line: n,
                detail: "MultipleFiles= (MIG): a GRES index then names several device files; gpuci does not serve MIG \
                         devices from a Slurm grant"
                    .into(),
            });
        }
        let Some(expr) = get("file") else {
            return Err(GresError::Unsupported {
                file: file.into(),
                line: n,
                detail: "a Name=gpu line without File=: its GPUs have no device files".into(),
            });
        };
        let files = expand_hostlist(expr).map_err(|e| conf_err(n, format!("File={expr}: {e}")))?;
        if let Some(count) = get("count") {
            if count.parse::<usize>().ok() != Some(files.len()) {
                return Err(conf_err(n, format!("Count={count} but File= names {} file(s)", files.len())));
            }
        }
        lines.push(GpuLine { line: n, type_name: get("type").map(str::to_string), files });
    }
    let autodetect = node_auto.or(global_auto).filter(|a| a != "off");
    Ok(GresConf { file: file.into(), lines, autodetect })
}

/// The `gpu` entries of a node's `Gres=` in slurm.conf, in order: (type, count).
pub type NodeGres = Vec<(Option<String>, u64)>;

/// The node's `gpu` entries of its `Gres=` in slurm.conf ([`NodeGres`]).
/// `Ok(None)`: slurm.conf has no line for the node.
pub fn parse_node_gres(text: &str, node: &str) -> Result<Option<NodeGres>, String> {
    let mut default_gres: Option<String> = None;
    for (n, l) in logical_lines(text) {
        let w = words(&l);
        let get = |k: &str| w.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
        let Some(names) = get("nodename") else { continue };
        if names.eq_ignore_ascii_case("default") {
            if let Some(g) = get("gres") {
                default_gres = Some(g.to_string());
            }
            continue;
        }
        if !names_node(names, node).map_err(|e| format!("line {n}: NodeName={names}: {e}"))? {
            continue;
        }
        let Some(gres) = get("gres").map(str::to_string).or_else(|| default_gres.clone()) else {
            return Ok(Some(Vec::new()));
        };
        let mut out = Vec::new();
        for entry in split_outside(&gres, ',', '(', ')') {
            // `gpu:a100:2(S:0-1)`: the socket suffix says nothing about order.
            let entry = entry.split('(').next().unwrap_or("").trim();
            let parts: Vec<&str> = entry.split(':').collect();
            if !parts[0].eq_ignore_ascii_case("gpu") {
                continue;
            }
            let count = |s: &str| s.parse::<u64>().map_err(|_| format!("line {n}: Gres={gres}: {s:?} is not a count"));
            match parts.as_slice() {
                [_] => out.push((None, 1)),
                [_, c] if c.bytes().all(|b| b.is_ascii_digit()) => out.push((None, count(c)?)),
                [_, t] => out.push((Some(t.to_string()), 1)),
                [_, t, c] => out.push((Some(t.to_string()), count(c)?)),
                _ => return Err(format!("line {n}: Gres={gres}: {entry:?} is not name[:type][:count]")),
            }
        }
        return Ok(Some(out));
    }
    Ok(None)
}

/// The node's GPU device files in Slurm's GRES order: position `i` is GRES index `i`.
/// `slurm_conf`: the node's `gpu` entries of `Gres=` ([`parse_node_gres`]), or why they
/// could not be read.
pub fn node_gpu_files(
    gres: &GresConf,
    node: &str,
    slurm_conf: Result<&[(Option<String>, u64)], String>,
) -> Result<Vec<String>, GresError> {
    if let Some(mechanism) = &gres.autodetect {
        return Err(GresError::AutoDetect { file: gres.file.clone(), node: node.into(), mechanism: mechanism.clone() });
    }
    if gres.lines.is_empty() {
        return Err(GresError::NoGpuLines { file: gres.file.clone(), node: node.into() });
    }
    let types: BTreeSet<String> =
        gres.lines.iter().map(|l| l.type_name.clone().unwrap_or_default().to_ascii_lowercase()).collect();
    let entries: NodeGres = match slurm_conf {
        Ok(e) => e.to_vec(),
        // Without slurm.conf, one type (or none) keeps gres.conf's order; several do not.
        Err(why) if types.len() > 1 => {
            return Err(GresError::TypeOrderUnknown {
                node: node.into(),
                types: types.into_iter().collect::<Vec<_>>().join(", "),
                why,
            })
        }
        Err(_) => return Ok(gres.lines.iter().flat_map(|l| l.files.clone()).collect()),
    };
    // Slurm's `_merge_gres2`: per slurm.conf entry, the first gres.conf lines of its type
    // (any type for an untyped entry), in file order, until its count is met.
    let mut left: Vec<Option<&GpuLine>> = gres.lines.iter().map(Some).collect();
    let mut files = Vec::new();
    for (t, count) in &entries {
        let mut need = *count;
        while need > 0 {
            let next = left.iter_mut().find(|l| {
                l.is_some_and(|l| match t {
                    None => true,
                    Some(t) => l.type_name.as_deref().is_some_and(|lt| lt.eq_ignore_ascii_case(t)),
                })
            });
            let Some(slot) = next else {
                return Err(GresError::CountMismatch {
                    node: node.into(),
                    detail: format!(
                        "slurm.conf's Gres= wants {count} gpu{} but gres.conf gives {} file(s) for it",
                        t.as_deref().map(|t| format!(":{t}")).unwrap_or_default(),
                        count - need
                    ),
                });
            };
            let line = slot.take().expect("found as Some");
            if line.files.len() as u64 > need {
                return Err(GresError::CountMismatch {
                    node: node.into(),
                    detail: format!(
                        "{}:{}: {} file(s), more than the {need} slurm.conf's Gres= leaves for gpu{}",
                        gres.file,
                        line.line,
                        line.files.len(),
                        t.as_deref().map(|t| format!(":{t}")).unwrap_or_default()
                    ),
                });
            }
            need -= line.files.len() as u64;
            files.extend(line.files.iter().cloned());
        }
    }
    if let Some(l) = left.iter().flatten().next() {
        return Err(GresError::CountMismatch {
            node: node.into(),
            detail: format!(
                "{}:{} (Type={}) is beyond slurm.conf's Gres= for the node: slurmd discards it",
                gres.file,
                l.line,
                l.type_name.as_deref().unwrap_or("(none)")
            ),
        });
    }
    Ok(files)
}

/// The GRES indices of `gpu` on `node` in `scontrol -d show job` output
/// (`Nodes=n1 CPU_IDs=0-1 Mem=0 GRES=gpu:a100:1(IDX:0),gpu:h100:1(IDX:2)`). `Ok(None)`: no
/// line for the node; `Ok(Some([]))`: the node's line names no GPU.
pub fn scontrol_job_indices(text: &str, node: &str) -> Result<Option<Vec<u32>>, String> {
    for line in text.lines() {
        let w: Vec<(&str, &str)> = line.split_whitespace().filter_map(|w| w.split_once('=')).collect();
        let Some((_, nodes)) = w.iter().find(|(k, _)| *k == "Nodes") else { continue };
        // The per-node lines carry CPU_IDs; the job's own `NodeList=`/`Nodes=` summary does not.
        if !w.iter().any(|(k, _)| *k == "CPU_IDs") || !names_node(nodes, node)? {
            continue;
        }
        let mut out = Vec::new();
        if let Some((_, gres)) = w.iter().find(|(k, _)| *k == "GRES") {
            for entry in split_outside(gres, ',', '(', ')') {
                if !entry.starts_with("gpu:") && entry != "gpu" {
                    continue;
                }
                let Some(idx) = entry.split_once("(IDX:").map(|(_, r)| r.trim_end_matches(')')) else {
                    return Err(format!("GRES entry {entry:?} names no IDX"));
                };
                if idx == "N/A" {
                    continue;
                }
                for i in parse_index_list(idx).map_err(|e| format!("GRES entry {entry:?}: {e}"))? {
                    if !out.contains(&i) {
                        out.push(i);
                    }
                }
            }
        }
        return Ok(Some(out));
    }
    Ok(None)
}

/// Whether this process may open a device file (`open(2)` of it, read-only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Opened, or refused by the device itself (ENXIO: no driver behind the minor): the
    /// device cgroup let it through.
    Allowed,
    /// EPERM: the device cgroup refused it.
    Denied,
    /// Missing, or refused for another reason (file permissions): says nothing.
    Unknown,
}

/// Everything the agent found out, as plain data; [`resolve`] decides.
#[derive(Clone, Debug)]
pub struct SlurmFacts {
    pub job_id: String,
    /// `SLURMD_NODENAME`.
    pub node: Option<String>,
    /// (`SLURM_JOB_GPUS` or `SLURM_STEP_GPUS`, its value).
    pub env_gpus: Option<(&'static str, String)>,
    /// `SLURM_GPUS_ON_NODE`.
    pub gpus_on_node: u32,
    /// `scontrol -d show job <id>`'s output, or why there is none.
    pub scontrol_job: Result<String, String>,
    /// gres.conf: (path, text), or why it could not be read.
    pub gres_conf: Result<(String, String), GresError>,
    /// slurm.conf's text, or why it could not be read.
    pub slurm_conf: Result<String, String>,
    /// The GPU device files probed (gres.conf's and `/dev/nvidiaN`), with what open said.
    pub access: Vec<(String, Access)>,
    /// `--expect-gpus`: how many GPUs the fleet asked Slurm for.
    pub expect: Option<u32>,
}

/// The device files of the GPUs Slurm granted this job, from `facts`; see the module header
/// for the rules. Empty: the job holds no GPU on this node.
pub fn resolve(f: &SlurmFacts) -> Result<Vec<String>, GresError> {
    let node = f.node.clone();
    let node_name = node.clone().unwrap_or_else(|| "(unknown)".into());
    let env = match &f.env_gpus {
        Some((var, v)) => {
            Some((*var, parse_index_list(v).map_err(|detail| GresError::List { what: var, expr: v.clone(), detail })?))
        }
        None => None,
    };
    let from_scontrol = match (&f.scontrol_job, &node) {
        (Ok(text), Some(node)) => scontrol_job_indices(text, node).map_err(|detail| GresError::List {
            what: "scontrol -d show job",
            expr: f.job_id.clone(),
            detail,
        })?,
        _ => None,
    };
    let indices = match (env, from_scontrol) {
        (Some((var, e)), Some(s)) => {
            if !e.iter().all(|i| s.contains(i)) || (var == "SLURM_JOB_GPUS" && e.len() != s.len()) {
                return Err(GresError::IndicesDisagree {
                    job: f.job_id.clone(),
                    node: node_name,
                    env_var: var,
                    env: e,
                    scontrol: s,
                });
            }
            e
        }
        (Some((_, e)), None) => e,
        (None, Some(s)) => s,
        (None, None) if f.gpus_on_node > 0 => {
            return Err(GresError::NoIndices { job: f.job_id.clone(), on_node: f.gpus_on_node })
        }
        (None, None) => Vec::new(),
    };
    let expected = |files: Vec<String>| match f.expect {
        Some(n) if n as usize != files.len() => {
            Err(GresError::UnexpectedCount { indices: indices.clone(), files, expect: n })
        }
        _ => Ok(files),
    };
    if indices.is_empty() {
        return expected(Vec::new());
    }
    // What the device cgroup shows: constraining only where it refuses some GPU file.
    let constrained = f.access.iter().any(|(_, a)| *a == Access::Denied);
    let allowed: BTreeSet<&str> =
        f.access.iter().filter(|(_, a)| *a == Access::Allowed).map(|(p, _)| p.as_str()).collect();
    let mapped = (|| -> Result<(Vec<String>, Vec<String>), GresError> {
        let (path, text) = f.gres_conf.clone()?;
        let gres = parse_gres_conf(&path, &text, node.as_deref())?;
        let slurm = match (&f.slurm_conf, &node) {
            (Ok(t), Some(n)) => match parse_node_gres(t, n) {
                Ok(Some(e)) => Ok(e),
                Ok(None) => Err(format!("slurm.conf has no NodeName line for {n}")),
                Err(e) => Err(format!("slurm.conf: {e}")),
            },
            (Err(e), _) => Err(e.clone()),
            (_, None) => Err("SLURMD_NODENAME is not set".into()),
        };
        let files = node_gpu_files(&gres, &node_name, slurm.as_deref().map_err(Clone::clone))?;
        let mapped = indices
            .iter()
            .map(|&i| {
                files.get(i as usize).cloned().ok_or_else(|| GresError::IndexOutOfRange {
                    index: i,
                    len: files.len(),
                    files: files.join(" "),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((mapped, files))
    })();
    let granted = match mapped {
        Ok((mapped, node_files)) => {
            if constrained {
                // Compared over the node's GRES files only: Slurm leaves a device file that is
                // in no gres.conf line (a GPU taken out of service) as it was.
                let mine: BTreeSet<&str> = mapped.iter().map(String::as_str).collect();
                let open: BTreeSet<&str> =
                    allowed.iter().copied().filter(|p| node_files.iter().any(|n| n.as_str() == *p)).collect();
                if mine != open {
                    return Err(GresError::CgroupDisagrees {
                        indices,
                        mapped,
                        allowed: open.iter().map(|s| s.to_string()).collect(),
                    });
                }
            }
            mapped
        }
        Err(e @ (GresError::IndexOutOfRange { .. } | GresError::List { .. })) => return Err(e),
        Err(e) if constrained && allowed.len() == indices.len() => {
            tracing::info!(error = %e, "gres.conf does not map the GRES indices; the job's device cgroup does");
            allowed.iter().map(|s| s.to_string()).collect()
        }
        Err(e) => return Err(GresError::NoMapping(Box::new(e))),
    };
    for file in &granted {
        minor_of(file)?;
    }
    expected(granted)
}

/// `/dev/nvidia3` → 3.
pub fn minor_of(file: &str) -> Result<u32, GresError> {
    let name = file.rsplit('/').next().unwrap_or("");
    name.strip_prefix("nvidia")
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|d| d.parse().ok())
        .ok_or_else(|| GresError::NotNvidia { file: file.into() })
}

/// What an open of `path` says about the device cgroup.
pub fn probe(path: &Path) -> Access {
    use nix::errno::Errno;
    match std::fs::File::open(path) {
        Ok(_) => Access::Allowed,
        Err(e) => match e.raw_os_error().map(Errno::from_raw) {
            // The device cgroup (v1 devices.deny, or v2's eBPF program) answers EPERM before
            // the driver is asked; file permissions answer EACCES.
            Some(Errno::EPERM) => Access::Denied,
            Some(Errno::ENXIO | Errno::ENODEV) => Access::Allowed,
            _ => Access::Unknown,
        },
    }
}

/// Gathers [`SlurmFacts`] for job `job_id` (reads slurm.conf and gres.conf beside
/// `$SLURM_CONF`, asks `scontrol`, probes the GPU device files) and resolves them.
pub async fn read_grant(
    job_id: &str,
    expect: Option<u32>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<String>, GresError> {
    let var = |k: &str| env(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    let conf = PathBuf::from(var("SLURM_CONF").unwrap_or_else(|| "/etc/slurm/slurm.conf".into()));
    let gres_path = conf.with_file_name("gres.conf");
    let read = |p: &Path| std::fs::read_to_string(p);
    let gres_conf = read(&gres_path)
        .map(|t| (gres_path.display().to_string(), t))
        .map_err(|e| GresError::Unreadable { file: gres_path.display().to_string(), detail: e.to_string() });
    let slurm_conf = read(&conf).map_err(|e| format!("cannot read {}: {e}", conf.display()));
    let node = var("SLURMD_NODENAME");
    let mut files: Vec<String> = Vec::new();
    if let Ok((p, t)) = &gres_conf {
        if let Ok(g) = parse_gres_conf(p, t, node.as_deref()) {
            files.extend(g.lines.into_iter().flat_map(|l| l.files));
        }
    }
    if let Ok(dir) = std::fs::read_dir("/dev") {
        for e in dir.flatten() {
            let p = e.path().display().to_string();
            if minor_of(&p).is_ok() && !files.contains(&p) {
                files.push(p);
            }
        }
    }
    let access = files.iter().map(|f| (f.clone(), probe(Path::new(f)))).collect();
    let facts = SlurmFacts {
        job_id: job_id.into(),
        node,
        env_gpus: var("SLURM_JOB_GPUS")
            .map(|v| ("SLURM_JOB_GPUS", v))
            .or_else(|| var("SLURM_STEP_GPUS").map(|v| ("SLURM_STEP_GPUS", v))),
        gpus_on_node: var("SLURM_GPUS_ON_NODE").and_then(|n| n.parse().ok()).unwrap_or(0),
        scontrol_job: scontrol_show_job(job_id).await,
        gres_conf,
        slurm_conf,
        access,
        expect,
    };
    tracing::debug!(?facts, "what Slurm shows of the job's GPUs");
    resolve(&facts)
}

/// `scontrol -d show job ID`, bounded.
async fn scontrol_show_job(job_id: &str) -> Result<String, String> {
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        tokio::process::Command::new("scontrol")
            .args(["-d", "show", "job", job_id])
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .map_err(|_| "scontrol did not answer within 20s".to_string())?
    .map_err(|e| format!("cannot run scontrol: {e}"))?;
    if !out.status.success() {
        return Err(format!("scontrol -d show job {job_id}: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout[..out.stdout.len().min(1 << 20)]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const N: &str = "gpu-node-3";

    /// Facts for a job on node N: gres.conf `gres`, slurm.conf line `Gres=<node_gres>`,
    /// `SLURM_JOB_GPUS=<job_gpus>`, no scontrol, nothing probed.
    fn facts(gres: &str, node_gres: &str, job_gpus: &str) -> SlurmFacts {
        SlurmFacts {
            job_id: "42".into(),
            node: Some(N.into()),
            env_gpus: Some(("SLURM_JOB_GPUS", job_gpus.into())),
            gpus_on_node: 0,
            scontrol_job: Err("not asked".into()),
            gres_conf: Ok(("/etc/slurm/gres.conf".into(), gres.into())),
            slurm_conf: Ok(format!("ClusterName=x\nNodeName={N} CPUs=8 Gres={node_gres} State=UNKNOWN\n")),
            access: Vec::new(),
            expect: None,
        }
    }

    fn files(v: &[u32]) -> Vec<String> {
        v.iter().map(|i| format!("/dev/nvidia{i}")).collect()
    }

    #[test]
    fn hostlists() {
        assert_eq!(expand_hostlist("/dev/nvidia[0-3,5]").unwrap(), files(&[0, 1, 2, 3, 5]));
        assert_eq!(expand_hostlist("/dev/nvidia[0,2,3]").unwrap(), files(&[0, 2, 3]));
        assert_eq!(expand_hostlist("/dev/nvidia4").unwrap(), files(&[4]));
        assert_eq!(expand_hostlist("/dev/nvidia[3,0]").unwrap(), files(&[3, 0]), "order as written");
        assert_eq!(expand_hostlist("tux[08-10]").unwrap(), ["tux08", "tux09", "tux10"]);
        assert_eq!(expand_hostlist("a,b[1-2]").unwrap(), ["a", "b1", "b2"]);
        assert_eq!(expand_hostlist("r[1-2]n[1-2]").unwrap(), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(
            expand_hostlist("/tmp/gpuci-slurm-x1/dev/nvidia[0-1]").unwrap(),
            ["/tmp/gpuci-slurm-x1/dev/nvidia0", "/tmp/gpuci-slurm-x1/dev/nvidia1"]
        );
        for bad in ["/dev/nvidia[0-", "/dev/nvidia[3-1]", "/dev/nvidia[x]", "a,,b", "a]", "n[-1]"] {
            assert!(expand_hostlist(bad).is_err(), "{bad}");
        }
    }

    /// The first case: a job granted /dev/nvidia4 sees SLURM_JOB_GPUS=0.
    #[test]
    fn file_list_not_starting_at_zero() {
        let f = facts("Name=gpu File=/dev/nvidia[4-7]\n", "gpu:4", "0");
        assert_eq!(resolve(&f).unwrap(), files(&[4]));
        let f = facts("Name=gpu File=/dev/nvidia[4-7]\n", "gpu:4", "1,3");
        assert_eq!(resolve(&f).unwrap(), files(&[5, 7]));
    }

    /// The second case: a broken GPU taken out; index 1 is nvidia2.
    #[test]
    fn file_list_with_a_gap() {
        let f = facts("# nvidia1 is out of service\nName=gpu File=/dev/nvidia[0,2,3]\n", "gpu:3", "1");
        assert_eq!(resolve(&f).unwrap(), files(&[2]));
        let f = facts("Name=gpu File=/dev/nvidia[0,2,3]\n", "gpu:3", "1-2");
        assert_eq!(resolve(&f).unwrap(), files(&[2, 3]));
        // Per-file lines, as gres.conf(5)'s own example writes them.
        let f =
            facts("Name=gpu File=/dev/nvidia0\nName=gpu File=/dev/nvidia2\nName=gpu File=/dev/nvidia3\n", "gpu:3", "2");
        assert_eq!(resolve(&f).unwrap(), files(&[3]));
    }

    /// Two typed lines: Slurm takes the types in slurm.conf's Gres= order (`_merge_gres2`),
    /// whatever order gres.conf writes them in.
    #[test]
    fn typed_split_across_two_lines_follows_slurm_conf_type_order() {
        let gres = "Name=gpu Type=a100 File=/dev/nvidia[0-1]\nName=gpu Type=h100 File=/dev/nvidia[2-3]\n";
        assert_eq!(resolve(&facts(gres, "gpu:a100:2,gpu:h100:2", "2")).unwrap(), files(&[2]));
        assert_eq!(resolve(&facts(gres, "gpu:h100:2,gpu:a100:2", "0")).unwrap(), files(&[2]));
        assert_eq!(resolve(&facts(gres, "gpu:h100:2,gpu:a100:2", "2,3")).unwrap(), files(&[0, 1]));
        // Types match case-insensitively, as Slurm's xstrcasecmp does; sockets say nothing.
        assert_eq!(resolve(&facts(gres, "gpu:H100:2(S:0),gpu:A100:2(S:1)", "1")).unwrap(), files(&[3]));
        // Untyped Gres=: gres.conf's order.
        assert_eq!(resolve(&facts(gres, "gpu:4", "2")).unwrap(), files(&[2]));
        // slurm.conf unreadable: several types cannot be ordered → refused.
        let mut f = facts(gres, "gpu:4", "0");
        f.slurm_conf = Err("cannot read /etc/slurm/slurm.conf: permission denied".into());
        let e = resolve(&f).unwrap_err();
        assert!(matches!(*unwrap_no_mapping(&e), GresError::TypeOrderUnknown { .. }), "{e}");
        assert!(e.to_string().contains("a100, h100"), "{e}");
        // One type only: gres.conf's order stands without slurm.conf.
        let mut f = facts("Name=gpu File=/dev/nvidia[4-7]\n", "gpu:4", "0");
        f.slurm_conf = Err("gone".into());
        assert_eq!(resolve(&f).unwrap(), files(&[4]));
    }

    fn unwrap_no_mapping(e: &GresError) -> Box<GresError> {
        match e {
            GresError::NoMapping(inner) => inner.clone(),
            other => Box::new(other.clone()),
        }
    }

    #[test]
    fn node_name_lines_and_autodetect() {
        let gres = "AutoDetect=nvml\n\
                    NodeName=gpu-node-[0-2] AutoDetect=off Name=gpu File=/dev/nvidia[0-3]\n\
                    NodeName=gpu-node-3 AutoDetect=off Name=gpu File=/dev/nvidia[0,2-3]\n\
                    NodeName=gpu-node-[4-15] Name=gpu File=/dev/nvidia[0-3]\n";
        assert_eq!(resolve(&facts(gres, "gpu:3", "1")).unwrap(), files(&[2]));
        // A node left to AutoDetect: the order is PCI bus order, not in gres.conf → refused.
        let mut f = facts(gres, "gpu:4", "1");
        f.node = Some("gpu-node-5".into());
        f.slurm_conf = Ok("NodeName=gpu-node-[4-15] Gres=gpu:4\n".into());
        let e = resolve(&f).unwrap_err();
        assert!(e.to_string().contains("AutoDetect=nvml applies to node gpu-node-5"), "{e}");
        // NodeName= lines and no SLURMD_NODENAME: refused.
        let mut f = facts(gres, "gpu:3", "1");
        f.node = None;
        assert!(matches!(*unwrap_no_mapping(&resolve(&f).unwrap_err()), GresError::NoNodeName));
        // Continued lines and comments.
        let f = facts("Name=gpu \\\n  File=/dev/nvidia[6-7] # two\n", "gpu:2", "1");
        assert_eq!(resolve(&f).unwrap(), files(&[7]));
    }

    /// SLURM_JOB_GPUS and scontrol's IDX are GRES indices; CUDA_VISIBLE_DEVICES and
    /// GPU_DEVICE_ORDINAL are renumbered under ConstrainDevices=yes and never read.
    #[test]
    fn which_variables_name_the_grant() {
        let gres = "Name=gpu File=/dev/nvidia[4-7]\n";
        let mut f = facts(gres, "gpu:4", "2");
        // What Slurm sets beside it under ConstrainDevices=yes: local numbers. Not read.
        f.scontrol_job = Ok(format!(
            "JobId=42 JobName=gpuci.hpc\n   JOB_GRES=gpu:1\n     Nodes={N} CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:2)\n"
        ));
        assert_eq!(resolve(&f).unwrap(), files(&[6]));
        // A step's SLURM_STEP_GPUS may be part of the job's.
        f.env_gpus = Some(("SLURM_STEP_GPUS", "2".into()));
        f.scontrol_job = Ok(format!("     Nodes={N} CPU_IDs=0-1 Mem=0 GRES=gpu:2(IDX:1-2)\n"));
        assert_eq!(resolve(&f).unwrap(), files(&[6]));
        // No variable (scrubbed environment): scontrol's IDX alone.
        f.env_gpus = None;
        assert_eq!(resolve(&f).unwrap(), files(&[5, 6]));
        // The two disagree: refused.
        f.env_gpus = Some(("SLURM_JOB_GPUS", "0".into()));
        let e = resolve(&f).unwrap_err();
        assert!(matches!(e, GresError::IndicesDisagree { .. }), "{e}");
        assert!(e.to_string().contains("IDX [1, 2] on node gpu-node-3"), "{e}");
        // Typed GRES with indices on several entries; another node's line is not ours.
        let text = "     Nodes=other CPU_IDs=0 Mem=0 GRES=gpu:a100:1(IDX:0)\n     \
                    Nodes=gpu-node-[2-3] CPU_IDs=0 Mem=0 GRES=gpu:a100:1(IDX:0),gpu:h100:1(IDX:2),shard:1(2/10,0/10)\n";
        assert_eq!(scontrol_job_indices(text, N), Ok(Some(vec![0, 2])));
        assert_eq!(scontrol_job_indices(text, "nowhere"), Ok(None));
        // A list that does not parse.
        let e = resolve(&facts(gres, "gpu:4", "0,x")).unwrap_err();
        assert!(e.to_string().contains("SLURM_JOB_GPUS \"0,x\": \"x\" is not an index"), "{e}");
        // Granted GPUs but no index anywhere: refused, not "all GPUs".
        let mut f = facts(gres, "gpu:4", "");
        f.env_gpus = None;
        f.gpus_on_node = 2;
        assert!(matches!(resolve(&f).unwrap_err(), GresError::NoIndices { on_node: 2, .. }));
        f.gpus_on_node = 0;
        assert_eq!(resolve(&f).unwrap(), Vec::<String>::new(), "no GPU granted");
    }

    /// Ambiguities are refused with the reason, never guessed.
    #[test]
    fn ambiguities_are_refused() {
        // gres.conf unreadable and nothing else to go on (scontrol gives indices only).
        let mut f = facts("", "gpu:4", "0");
        f.gres_conf =
            Err(GresError::Unreadable { file: "/etc/slurm/gres.conf".into(), detail: "Permission denied".into() });
        let e = resolve(&f).unwrap_err().to_string();
        assert!(e.contains("cannot read /etc/slurm/gres.conf") && e.contains("ConstrainDevices=yes would"), "{e}");
        // An index past the list.
        let e = resolve(&facts("Name=gpu File=/dev/nvidia[0,2,3]\n", "gpu:3", "3")).unwrap_err();
        assert!(e.to_string().contains("GRES index 3 is past the node's 3"), "{e}");
        // slurm.conf and gres.conf disagree on the count: Slurm would truncate or pad.
        let e = resolve(&facts("Name=gpu File=/dev/nvidia[0-3]\n", "gpu:2", "0")).unwrap_err();
        assert!(e.to_string().contains("more than the 2"), "{e}");
        let e = resolve(&facts("Name=gpu File=/dev/nvidia[0-1]\n", "gpu:4", "0")).unwrap_err();
        assert!(e.to_string().contains("wants 4 gpu but gres.conf gives 2"), "{e}");
        let e = resolve(&facts(
            "Name=gpu Type=a100 File=/dev/nvidia[0-1]\nName=gpu Type=l4 File=/dev/nvidia2\n",
            "gpu:a100:2",
            "0",
        ))
        .unwrap_err();
        assert!(e.to_string().contains("(Type=l4) is beyond slurm.conf's Gres="), "{e}");
        // Count= against File=; MIG; a gpu line without files; not an NVIDIA file.
        let e = resolve(&facts("Name=gpu Count=4 File=/dev/nvidia[0-2]\n", "gpu:3", "0")).unwrap_err();
        assert!(e.to_string().contains("gres.conf:1: Count=4 but File= names 3"), "{e}");
        let e = resolve(&facts("Name=gpu MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap21\n", "gpu:1", "0"))
            .unwrap_err();
        assert!(e.to_string().contains("MultipleFiles= (MIG)"), "{e}");
        let e = resolve(&facts("Name=gpu Count=2\n", "gpu:2", "0")).unwrap_err();
        assert!(e.to_string().contains("without File="), "{e}");
        let e = resolve(&facts("Name=gpu File=/dev/dri/renderD[128-129]\n", "gpu:2", "0")).unwrap_err();
        assert!(matches!(e, GresError::NotNvidia { .. }), "{e}");
        // A grant of another size than the fleet asked for (--expect-gpus).
        let mut f = facts("Name=gpu File=/dev/nvidia[4-7]\n", "gpu:4", "0,1");
        f.expect = Some(1);
        let e = resolve(&f).unwrap_err();
        assert!(e.to_string().contains("Slurm granted 2 GPU(s) on this node (GRES indices [0, 1]"), "{e}");
        f.env_gpus = None;
        assert!(matches!(resolve(&f).unwrap_err(), GresError::UnexpectedCount { expect: 1, .. }), "none granted");
        f.expect = Some(0);
        assert_eq!(resolve(&f).unwrap(), Vec::<String>::new());
        // mps and shard lines are other GRES: not in the gpu list.
        let f =
            facts("Name=gpu File=/dev/nvidia[2-3]\nName=mps Count=200 File=/dev/nvidia[2-3]\n", "gpu:2,mps:200", "1");
        assert_eq!(resolve(&f).unwrap(), files(&[3]));
    }

    /// The job's device cgroup (ConstrainDevices=yes) is Slurm's own enforcement: the
    /// mapping must agree with it, and it stands in where gres.conf cannot be read.
    #[test]
    fn the_device_cgroup_checks_and_stands_in() {
        let probed = |allowed: &[u32], denied: &[u32]| {
            let mut v: Vec<(String, Access)> =
                allowed.iter().map(|i| (format!("/dev/nvidia{i}"), Access::Allowed)).collect();
            v.extend(denied.iter().map(|i| (format!("/dev/nvidia{i}"), Access::Denied)));
            v
        };
        let mut f = facts("Name=gpu File=/dev/nvidia[0,2,3]\n", "gpu:3", "1");
        f.access = probed(&[2], &[0, 3]);
        assert_eq!(resolve(&f).unwrap(), files(&[2]));
        // What today's reading (index as minor) would serve is refused by the cgroup.
        f.access = probed(&[1], &[0, 2, 3]);
        let e = resolve(&f).unwrap_err();
        assert!(matches!(e, GresError::CgroupDisagrees { .. }), "{e}");
        // gres.conf unreadable: the cgroup's one open GPU is the one index's.
        f.gres_conf = Err(GresError::Unreadable { file: "/etc/slurm/gres.conf".into(), detail: "gone".into() });
        f.access = probed(&[2], &[0, 3]);
        assert_eq!(resolve(&f).unwrap(), files(&[2]));
        // ... but not when the numbers differ.
        f.access = probed(&[2, 3], &[0]);
        assert!(matches!(resolve(&f).unwrap_err(), GresError::NoMapping(_)));
        // A GPU in no gres.conf line (taken out of service) is left open by Slurm: not a
        // disagreement.
        let mut f = facts("Name=gpu File=/dev/nvidia[0,2,3]\n", "gpu:3", "1");
        f.access = probed(&[1, 2], &[0, 3]);
        assert_eq!(resolve(&f).unwrap(), files(&[2]));
        // Everything open: no constraint, nothing learnt; the mapping stands alone.
        let mut f = facts("Name=gpu File=/dev/nvidia[4-7]\n", "gpu:4", "0");
        f.access = probed(&[4, 5, 6, 7], &[]);
        assert_eq!(resolve(&f).unwrap(), files(&[4]));
    }

    #[test]
    fn minors() {
        assert_eq!(minor_of("/dev/nvidia12"), Ok(12));
        assert!(minor_of("/dev/nvidiactl").is_err());
        assert!(minor_of("/dev/nvidia-uvm").is_err());
    }
}
