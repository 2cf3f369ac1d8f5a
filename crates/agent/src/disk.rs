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

#[cfg(test)]
mod tests {
    use super::*;

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
