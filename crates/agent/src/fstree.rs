//! Removing a tree a job built, however deep.
//!
//! `std::fs::remove_dir_all` recurses once per directory level (it walks with `openat`, so
//! no path length stops it): a job that nests 30,000 directories in its workspace overflowed
//! the agent's stack when the workspace was removed, and every job on the host was lost.
//! [`remove_tree`] never recurses and holds two descriptors at most: it empties the root by
//! moving the entries of each non-empty subdirectory up into the root (one `renameat2` each,
//! never replacing anything), then removes the directory, until the root is empty. Links are
//! never followed: entries are unlinked or moved by name relative to an open directory.

use nix::dir::{Dir, Type};
use nix::errno::Errno;
use nix::fcntl::{renameat2, OFlag, RenameFlags};
use nix::sys::stat::Mode;
use nix::unistd::{unlinkat, UnlinkatFlags};
use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

/// The entries of `dir` (without `.` and `..`), with whether each is a directory.
fn entries(dir: &mut Dir) -> io::Result<Vec<(CString, bool)>> {
    let fd = dir.as_raw_fd();
    let mut out = Vec::new();
    for e in dir.iter() {
        let e = e.map_err(io::Error::from)?;
        let name = e.file_name();
        if name.to_bytes() == b"." || name.to_bytes() == b".." {
            continue;
        }
        let is_dir = match e.file_type() {
            Some(t) => t == Type::Directory,
            None => nix::sys::stat::fstatat(Some(fd), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
                .map(|st| {
                    use nix::sys::stat::SFlag;
                    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR
                })
                .unwrap_or(false),
        };
        out.push((name.to_owned(), is_dir));
    }
    Ok(out)
}

/// Removes `path` and everything below it; a file or link is just unlinked. Missing is fine.
pub fn remove_tree(path: &Path) -> io::Result<()> {
    let m = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !m.is_dir() {
        return std::fs::remove_file(path);
    }
    let mut moved: u64 = 0;
    loop {
        let mut root = Dir::open(path, dir_flags(), Mode::empty()).map_err(io::Error::from)?;
        let rootfd = root.as_raw_fd();
        let list = entries(&mut root)?;
        if list.is_empty() {
            break;
        }
        for (name, is_dir) in list {
            if !is_dir {
                match unlinkat(Some(rootfd), name.as_c_str(), UnlinkatFlags::NoRemoveDir) {
                    Ok(()) | Err(Errno::ENOENT) => {}
                    Err(e) => return Err(e.into()),
                }
                continue;
            }
            match unlinkat(Some(rootfd), name.as_c_str(), UnlinkatFlags::RemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => continue,
                Err(Errno::ENOTEMPTY | Errno::EEXIST) => {}
                Err(e) => return Err(e.into()),
            }
            // Not empty: lift its entries into the root, then it is.
            let mut child =
                Dir::openat(Some(rootfd), name.as_c_str(), dir_flags(), Mode::empty()).map_err(io::Error::from)?;
            let childfd = child.as_raw_fd();
            for (entry, _) in entries(&mut child)? {
                loop {
                    moved += 1;
                    let to = format!(".gpuci-rm-{moved}");
                    match renameat2(
                        Some(childfd),
                        entry.as_c_str(),
                        Some(rootfd),
                        to.as_str(),
                        RenameFlags::RENAME_NOREPLACE,
                    ) {
                        Ok(()) | Err(Errno::ENOENT) => break,
                        Err(Errno::EEXIST) => continue,
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            drop(child);
            match unlinkat(Some(rootfd), name.as_c_str(), UnlinkatFlags::RemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    std::fs::remove_dir(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (outsider attack): 30,000 nested directories overflowed the agent's stack in
    /// `std::fs::remove_dir_all`. Run on a thread with a small stack to prove no recursion.
    #[test]
    fn a_very_deep_tree_is_removed_without_recursion() {
        let t = tempfile::tempdir().expect("tempdir");
        let root = t.path().join("ws");
        std::fs::create_dir(&root).expect("mkdir");
        // Build it by descending with a moving directory handle: paths this deep exceed PATH_MAX.
        let mut fd = nix::fcntl::open(&root, dir_flags(), Mode::empty()).expect("open");
        for i in 0..30_000 {
            nix::sys::stat::mkdirat(Some(fd), "d", Mode::from_bits_truncate(0o755)).expect("mkdirat");
            if i % 1000 == 0 {
                let f = nix::fcntl::openat(
                    Some(fd),
                    "f",
                    OFlag::O_CREAT | OFlag::O_WRONLY,
                    Mode::from_bits_truncate(0o644),
                )
                .expect("file");
                nix::unistd::close(f).expect("close");
            }
            let next = nix::fcntl::openat(Some(fd), "d", dir_flags(), Mode::empty()).expect("openat");
            nix::unistd::close(fd).expect("close");
            fd = next;
        }
        nix::unistd::close(fd).expect("close");
        let r = root.clone();
        let removed = std::thread::Builder::new()
            .stack_size(64 * 1024)
            .spawn(move || remove_tree(&r))
            .expect("thread")
            .join()
            .expect("no panic");
        removed.expect("removed");
        assert!(!root.exists());
    }

    #[test]
    fn links_are_removed_not_followed_and_files_and_missing_paths_are_fine() {
        let t = tempfile::tempdir().expect("tempdir");
        let outside = t.path().join("outside");
        std::fs::create_dir(&outside).expect("mkdir");
        std::fs::write(outside.join("keep"), "x").expect("write");
        let root = t.path().join("ws");
        std::fs::create_dir_all(root.join("a/b/.gpuci-rm-1")).expect("mkdir");
        std::fs::write(root.join("a/b/.gpuci-rm-1/f"), "x").expect("write");
        std::fs::write(root.join(".gpuci-rm-1"), "clash").expect("write");
        std::os::unix::fs::symlink(&outside, root.join("a/link")).expect("symlink");
        remove_tree(&root).expect("removed");
        assert!(!root.exists());
        assert!(outside.join("keep").exists(), "a link was followed");
        let file = t.path().join("file");
        std::fs::write(&file, "x").expect("write");
        remove_tree(&file).expect("file removed");
        assert!(!file.exists());
        remove_tree(&t.path().join("missing")).expect("missing is fine");
    }
}
