//! Free space on the agent's disk. Below a floor (`--min-free-disk`) the agent takes no new
//! jobs and says why (`gpuci agents`): every job it took would fail writing its journal,
//! workspace or output, one after another. Jobs it runs go on. It takes jobs again once the
//! free space is back above the floor by a margin, so a disk at the edge does not flap.
//!
//! [`decide`] is pure; [`free_bytes`] reads the filesystem.

use std::path::Path;

/// How far above the floor free space must climb before a paused agent takes jobs again:
/// a quarter of the floor.
fn resume_margin(floor: u64) -> u64 {
    floor / 4
}

/// Whether the agent takes no new jobs, and why. `free`: the least free space among the
/// filesystems it writes jobs to (`dir` is the one with that least, for the reason); `floor`:
/// 0 means never pause; `paused`: whether it is paused now.
pub fn decide(dir: &Path, free: u64, floor: u64, paused: bool) -> Option<String> {
    let pause = floor > 0 && if paused { free < floor + resume_margin(floor) } else { free < floor };
    pause.then(|| {
        format!(
            "its disk is nearly full: {} free on the filesystem of {}, under --min-free-disk {}; it takes \
             jobs again once {} are free",
            gpuci_core::quantity::Bytes(free),
            dir.display(),
            gpuci_core::quantity::Bytes(floor),
            gpuci_core::quantity::Bytes(floor + resume_margin(floor))
        )
    })
}

/// Bytes an unprivileged writer may still use on the filesystem holding `dir`.
pub fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    let st = nix::sys::statvfs::statvfs(dir).map_err(std::io::Error::from)?;
    Ok(st.blocks_available().saturating_mul(st.fragment_size()))
}

/// Smallest disk a slot is given when the host cannot hold the size asked for.
pub const MIN_SLOT_DISK: u64 = 256 << 20;

/// The size of each slot's disk: `requested` (`--job-disk`), or less where the host's disk
/// cannot hold `slots` of them above the `floor` (`--min-free-disk`). Slot disks are sparse
/// images: sized past what the host has, a job could fill the host's disk before its own,
/// which is what the disk quota exists to prevent (outsider attack: 4 × 20 GiB promised on 74
/// GiB free). `free` is measured with no slot image present. Returns the size and, when it is
/// less than asked, why (said loudly by the agent); `Err` when not even [`MIN_SLOT_DISK`] fits.
pub fn slot_disk_size(requested: u64, free: u64, floor: u64, slots: u32) -> Result<(u64, Option<String>), String> {
    use gpuci_core::quantity::Bytes;
    let slots = u64::from(slots.max(1));
    let room = free.saturating_sub(floor) / slots;
    if requested <= room {
        return Ok((requested, None));
    }
    // Whole MiB, so sizes read well.
    let size = room & !((1 << 20) - 1);
    if size < MIN_SLOT_DISK {
        return Err(format!(
            "the host's disk has {} free: not enough for {slots} slot disks of even {} above --min-free-disk {} \
             (free space, or use fewer --slots)",
            Bytes(free),
            Bytes(MIN_SLOT_DISK),
            Bytes(floor)
        ));
    }
    Ok((
        size,
        Some(format!(
            "--job-disk {} for {slots} slots would promise more than the host's disk has ({} free, --min-free-disk {}): \
             each slot gets {}",
            Bytes(requested),
            Bytes(free),
            Bytes(floor),
            Bytes(size)
        )),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_disks_never_promise_more_than_the_host_has() {
        const G: u64 = 1 << 30;
        assert_eq!(slot_disk_size(20 * G, 200 * G, G, 4), Ok((20 * G, None)));
        let (size, why) = slot_disk_size(20 * G, 74 * G, G, 4).unwrap();
        assert!(size * 4 + G <= 74 * G && size > 18 * G, "{size}");
        assert!(why.unwrap_or_default().contains("each slot gets"));
        assert!(slot_disk_size(20 * G, G + 100 * (1 << 20), G, 4).is_err());
    }

    #[test]
    fn an_agent_pauses_under_the_floor_and_resumes_only_past_the_margin() {
        let d = Path::new("/var/lib/gpuci-agent");
        const G: u64 = 1 << 30;
        assert_eq!(decide(d, 5 * G, G, false), None);
        let why = decide(d, G / 2, G, false).unwrap_or_default();
        assert!(why.contains("/var/lib/gpuci-agent") && why.contains("--min-free-disk"), "{why}");
        // Just back over the floor: still paused; past the margin: taking jobs.
        assert!(decide(d, G + G / 8, G, true).is_some());
        assert_eq!(decide(d, G + G / 4, G, true), None);
        // A floor of 0 never pauses.
        assert_eq!(decide(d, 0, 0, false), None);
    }
}
