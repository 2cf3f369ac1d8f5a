//! Placement: which host runs a job, and which GPU UUIDs it leases there.
//!
//! Rules: a GPU is leased to at most one job; a multi-GPU job gets all its GPUs on one host;
//! among hosts that fit, prefer the one that leaves the fewest stranded GPUs (best fit: the
//! host with the fewest free matching GPUs that still has enough). When nothing fits, the
//! answer is a reason a person can act on ("needs 2 GPUs with >=40 GiB; best host has 1 free").

use crate::gpu::{mismatch, GpuInfo, GpuRequirements};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Whether a GPU can take a lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum GpuSlotState {
    Free,
    Leased { job_id: String },
    Quarantined { reason: String },
}

/// One GPU as placement sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSlot {
    pub info: GpuInfo,
    pub state: GpuSlotState,
}

/// A connected host as placement sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostView {
    pub agent_id: String,
    pub name: String,
    pub tags: BTreeMap<String, String>,
    pub free_slots: u32,
    pub total_slots: u32,
    pub container_runtime: bool,
    pub gpus: Vec<GpuSlot>,
}

/// What a job needs from a host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Needs<'a> {
    pub tags: &'a BTreeMap<String, String>,
    pub gpu: &'a GpuRequirements,
    pub container: bool,
}

/// Where a job goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Index into the `hosts` slice given to [`place`].
    pub host: usize,
    /// Leased GPU UUIDs, in device index order.
    pub gpus: Vec<String>,
}

/// Why a job cannot be placed now, in words for a person.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unplaceable {
    pub reason: String,
}

/// Place one job on `hosts`. Pure: the caller applies the placement (marks the GPUs leased
/// and takes a slot) before placing the next job.
pub fn place(needs: &Needs<'_>, hosts: &[HostView]) -> Result<Placement, Unplaceable> {
    if hosts.is_empty() {
        return Err(Unplaceable { reason: "no agent is connected".into() });
    }
    let want = needs.gpu.count as usize;
    let mut best: Option<(usize, usize)> = None; // (host, free matching gpus)
    let mut tag_ok = 0usize;
    let mut runtime_ok = 0usize;
    let mut best_partial: usize = 0; // most free matching GPUs on any eligible host
    let mut slot_blocked = 0usize;
    let mut gpu_mismatch: Option<String> = None;
    for (i, h) in hosts.iter().enumerate() {
        if !needs.tags.iter().all(|(k, v)| h.tags.get(k) == Some(v)) {
            continue;
        }
        tag_ok += 1;
        if needs.container && !h.container_runtime {
            continue;
        }
        runtime_ok += 1;
        let mut free = 0usize;
        for g in &h.gpus {
            if want == 0 {
                break;
            }
            match mismatch(needs.gpu, &g.info) {
                Some(why) => {
                    gpu_mismatch.get_or_insert(why);
                }
                None if g.state == GpuSlotState::Free => free += 1,
                None => {}
            }
        }
        if want > 0 {
            best_partial = best_partial.max(free);
            if free < want {
                continue;
            }
        }
        if h.free_slots == 0 {
            slot_blocked += 1;
            continue;
        }
        if best.is_none_or(|(_, f)| free < f) {
            best = Some((i, free));
        }
    }
    if let Some((host, _)) = best {
        let mut gpus: Vec<&GpuSlot> = hosts[host]
            .gpus
            .iter()
            .filter(|g| g.state == GpuSlotState::Free && mismatch(needs.gpu, &g.info).is_none())
            .collect();
        gpus.sort_by_key(|g| g.info.index);
        let gpus = gpus.into_iter().take(want).map(|g| g.info.uuid.clone()).collect();
        return Ok(Placement { host, gpus });
    }
    let reason = if tag_ok == 0 {
        let tags: Vec<String> = needs.tags.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!("no connected agent has tag {}", tags.join(", "))
    } else if runtime_ok == 0 {
        "needs a container runtime; no matching agent has podman or docker".into()
    } else if want > 0 && best_partial < want {
        let mut what = format!("needs {want} GPU{}", if want == 1 { "" } else { "s" });
        if let Some(c) = &needs.gpu.memory {
            what.push_str(&format!(" with {c}"));
        }
        match gpu_mismatch {
            Some(why) if best_partial == 0 => format!("{what}; no free GPU matches (e.g. {why})"),
            _ => format!("{what}; best host has {best_partial} free"),
        }
    } else if slot_blocked > 0 {
        format!("all {slot_blocked} matching agent(s) are busy (no free job slot)")
    } else {
        "no agent can run it".into()
    };
    Err(Unplaceable { reason })
}
