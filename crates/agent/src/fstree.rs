//! Walking and removing trees a job built, however deep or wide.
//!
//! Nothing here recurses: a job decides how deep its workspace and its cached paths are, and
//! any walk that takes a stack frame per level is a way to crash the agent (and every job on
//! the host with it).
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
use std::path::{Path, PathBuf};

/// Visits `root` and every entry below it, each directory before what it holds, with the
/// entry's path relative to `root` (empty for `root` itself) and its metadata; links are
/// reported, never followed. No recursion: pending directories wait on a heap stack. Paths
/// longer than the kernel takes (`PATH_MAX`, some 2,000 levels of one-letter names) end the
/// walk with an error, so a caller refuses such a tree rather than half-handling it.
pub fn walk(root: &Path, mut visit: impl FnMut(&Path, &std::fs::Metadata) -> io::Result<()>) -> io::Result<()> {
    let mut pending: Vec<PathBuf> = vec![PathBuf::new()];
    while let Some(rel) = pending.pop() {
        let full = if rel.as_os_str().is_empty() { root.to_path_buf() } else { root.join(&rel) };
        let m = std::fs::symlink_metadata(&full).map_err(|e| in_path(&rel, e))?;
        visit(&rel, &m)?;
        if m.is_dir() {
            for c in std::fs::read_dir(&full).map_err(|e| in_path(&rel, e))? {
                pending.push(rel.join(c.map_err(|e| in_path(&rel, e))?.file_name()));
            }
        }
    }
    Ok(())
}

/// `e` with the (relative) path it happened at.
fn in_path(rel: &Path, e: io::Error) -> io::Error {
    let shown = if rel.as_os_str().is_empty() { ".".to_string() } else { rel.display().to_string() };
    io::Error::new(e.kind(), format!("{shown}: {e}"))
}

/// Makes `user` the owner of `path` and everything under it, never following a symlink (a
/// job's files are the job's; the agent, as root, must not be led out of the tree). Called on
/// a workspace after it was filled and before the job starts.
pub fn give_to(path: &Path, user: gpuci_sandbox::JobUser) -> io::Result<()> {
    walk(path, |rel, _| {
        let p = if rel.as_os_str().is_empty() { path.to_path_buf() } else { path.join(rel) };
        std::os::unix::fs::lchown(&p, Some(user.uid), Some(user.gid)).map_err(|e| in_path(rel, e))
    })
}

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
            // Not empty: its files go where they are (an unlink needs no room), then its
            // directories are lifted into the root, and it is empty. Lifting files too would
            // add an entry to the root for each, which needs room the job may have taken: a
            // directory of 500,000 hard links on a full slot disk could not be removed
            // (outsider attack), and the slot failed every later job.
            let mut child =
                Dir::openat(Some(rootfd), name.as_c_str(), dir_flags(), Mode::empty()).map_err(io::Error::from)?;
            let childfd = child.as_raw_fd();
            let list = entries(&mut child)?;
            for (entry, is_dir) in &list {
                if !is_dir {
                    match unlinkat(Some(childfd), entry.as_c_str(), UnlinkatFlags::NoRemoveDir) {
                        Ok(()) | Err(Errno::ENOENT) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            for (entry, _) in list.into_iter().filter(|(_, is_dir)| *is_dir) {
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

    /// Regression (outsider attack): 800 nested directories in a cached path overflowed the
    /// agent's stack in the cache's recursive walks. A walk takes no stack per level.
    #[test]
    fn a_deep_tree_is_walked_without_recursion() {
        let t = tempfile::tempdir().expect("tempdir");
        let root = t.path().join("ws");
        let mut deepest = root.clone();
        for _ in 0..1500 {
            deepest.push("d");
        }
        std::fs::create_dir_all(&deepest).expect("mkdir");
        std::fs::write(deepest.join("f"), "x").expect("write");
        let r = root.clone();
        let (dirs, files) = std::thread::Builder::new()
            .stack_size(64 * 1024)
            .spawn(move || {
                let (mut dirs, mut files) = (0, 0);
                walk(&r, |_, m| {
                    if m.is_dir() {
                        dirs += 1;
                    } else {
                        files += 1;
                    }
                    Ok(())
                })
                .map(|()| (dirs, files))
            })
            .expect("thread")
            .join()
            .expect("no stack overflow")
            .expect("walked");
        assert_eq!((dirs, files), (1501, 1));
        remove_tree(&root).expect("removed");
    }

    #[test]
    fn a_walk_reports_links_without_following_them() {
        let t = tempfile::tempdir().expect("tempdir");
        let outside = t.path().join("outside");
        std::fs::create_dir_all(outside.join("secret")).expect("mkdir");
        let root = t.path().join("ws");
        std::fs::create_dir_all(root.join("a")).expect("mkdir");
        std::os::unix::fs::symlink(&outside, root.join("a/link")).expect("symlink");
        let mut seen = Vec::new();
        walk(&root, |rel, m| {
            seen.push((rel.to_path_buf(), m.file_type().is_symlink()));
            Ok(())
        })
        .expect("walked");
        seen.sort();
        assert_eq!(seen, vec![(PathBuf::new(), false), (PathBuf::from("a"), false), (PathBuf::from("a/link"), true)]);
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
