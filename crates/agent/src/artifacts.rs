//! A job's artifacts on disk: finding the files its `artifacts:` patterns name when the step
//! has ended ([`collect`]), and placing the artifacts of earlier steps into a new workspace
//! ([`create_in`]). The HTTP side is `artifacts_http`.
//!
//! The workspace is the job's and the job is hostile: it may have left symlinks to `/etc`,
//! loops, fifos, device nodes, sparse files of terabytes, names with newlines, or a process
//! that swaps a file for a link while we look. So:
//! - every path component is opened relative to an open directory with `O_NOFOLLOW`
//!   (`rustix::fs::openat`), never by a path string; a link anywhere is refused, never
//!   followed, so nothing outside the workspace is ever read or written;
//! - a file's type and size are checked on the opened descriptor (`fstat`), not before it
//!   is opened; files are opened `O_NONBLOCK` so a fifo swapped in cannot hang the agent;
//! - only regular files are artifacts; every refusal has its reason, for the job's log;
//! - the walk starts at the patterns' literal bases, holds one directory open at a time,
//!   never recurses, and stops at [`MAX_DEPTH`] levels and [`MAX_ENTRIES`] entries.

use gpuci_core::artifacts::{check_path, Patterns};
use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, CWD};
use rustix::io::Errno;
use std::os::fd::OwnedFd;
use std::path::Path;

/// Deepest directory walked below the workspace.
pub const MAX_DEPTH: usize = 128;
/// Most directory entries looked at for one job's artifacts.
pub const MAX_ENTRIES: u64 = 1_000_000;

/// What the walk found: a file to upload, opened, or a path refused with the reason.
#[derive(Debug)]
pub enum Found {
    File { path: String, file: std::fs::File, size: u64 },
    Refused { path: String, reason: String },
}

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

fn kind(t: FileType) -> &'static str {
    match t {
        FileType::RegularFile => "a regular file",
        FileType::Directory => "a directory",
        FileType::Symlink => "a symbolic link",
        FileType::Fifo => "a named pipe (fifo)",
        FileType::Socket => "a socket",
        FileType::CharacterDevice | FileType::BlockDevice => "a device file",
        _ => "not a regular file",
    }
}

/// Why opening a directory component failed, in words.
fn not_a_dir(e: Errno) -> String {
    match e {
        Errno::LOOP | Errno::NOTDIR => {
            "a symbolic link or a file where a directory was expected; links are never followed".into()
        }
        e => format!("cannot be opened: {e}"),
    }
}

/// Opens `rel` (`/`-separated, relative) below `root`, one component at a time, each with
/// `O_NOFOLLOW`. `Err`: the prefix that failed and why.
fn open_dir(root: &OwnedFd, rel: &str) -> Result<OwnedFd, (String, Errno)> {
    let mut cur = rustix::fs::openat(root, ".", dir_flags(), Mode::empty()).map_err(|e| (String::new(), e))?;
    if rel.is_empty() {
        return Ok(cur);
    }
    let mut so_far = String::new();
    for comp in rel.split('/') {
        if !so_far.is_empty() {
            so_far.push('/');
        }
        so_far.push_str(comp);
        cur = rustix::fs::openat(&cur, comp, dir_flags(), Mode::empty()).map_err(|e| (so_far.clone(), e))?;
    }
    Ok(cur)
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

/// Finds every regular file under `workspace` that `patterns` match, handing each to `sink`
/// opened (or refused, with the reason) as it is found; `sink` returns false to stop.
/// Files over `max_file` bytes are refused without being read. `Err`: the workspace itself
/// could not be opened.
pub fn collect(
    workspace: &Path,
    patterns: &Patterns,
    max_file: u64,
    mut sink: impl FnMut(Found) -> bool,
) -> std::io::Result<()> {
    let root = rustix::fs::openat(CWD, workspace, dir_flags(), Mode::empty())?;
    let refuse = |path: &str, reason: String| Found::Refused { path: path.to_string(), reason };
    let mut pending: Vec<(String, usize)> = Vec::new();
    for base in patterns.bases() {
        match open_dir(&root, base) {
            Ok(_) => pending.push((base.clone(), base.split('/').filter(|c| !c.is_empty()).count())),
            Err((_, Errno::NOENT)) => {}
            Err((at, e)) => {
                if !sink(refuse(&at, not_a_dir(e))) {
                    return Ok(());
                }
            }
        }
    }
    let mut visited: u64 = 0;
    while let Some((rel, depth)) = pending.pop() {
        let dirfd = match open_dir(&root, &rel) {
            Ok(fd) => fd,
            Err((at, e)) => {
                if !sink(refuse(&at, format!("changed while being read: {}", not_a_dir(e)))) {
                    return Ok(());
                }
                continue;
            }
        };
        let entries = match Dir::read_from(&dirfd) {
            Ok(d) => d,
            Err(e) => {
                if !sink(refuse(&rel, format!("cannot be listed: {e}"))) {
                    return Ok(());
                }
                continue;
            }
        };
        for entry in entries {
            let Ok(entry) = entry else { break };
            let raw = entry.file_name().to_bytes();
            if raw == b"." || raw == b".." {
                continue;
            }
            visited += 1;
            if visited > MAX_ENTRIES {
                sink(refuse(
                    &rel,
                    format!("more than {MAX_ENTRIES} entries under the artifact paths; the rest were not looked at"),
                ));
                return Ok(());
            }
            let name = match std::str::from_utf8(raw) {
                Ok(n) => n.to_string(),
                Err(_) => {
                    let lossy = join(&rel, &String::from_utf8_lossy(raw));
                    if patterns.matches(&lossy) && !sink(refuse(&lossy, "the name is not UTF-8".into())) {
                        return Ok(());
                    }
                    continue;
                }
            };
            let child = join(&rel, &name);
            let Ok(st) = rustix::fs::statat(&dirfd, entry.file_name(), AtFlags::SYMLINK_NOFOLLOW) else {
                // Gone since the listing.
                continue;
            };
            let t = FileType::from_raw_mode(st.st_mode);
            let result = match t {
                FileType::Directory if depth + 1 > MAX_DEPTH => {
                    if patterns.matches(&format!("{child}/x")) {
                        Some(refuse(&child, format!("deeper than {MAX_DEPTH} directory levels; not looked at")))
                    } else {
                        None
                    }
                }
                FileType::Directory => {
                    pending.push((child, depth + 1));
                    None
                }
                _ if !patterns.matches(&child) => None,
                FileType::RegularFile => Some(open_file(&dirfd, entry.file_name(), &child, max_file)),
                FileType::Symlink => {
                    let to = rustix::fs::readlinkat(&dirfd, entry.file_name(), Vec::new())
                        .map(|t| format!(" (to {:?})", t.to_string_lossy()))
                        .unwrap_or_default();
                    Some(refuse(
                        &child,
                        format!(
                            "a symbolic link{to}; links are never followed, copy the file into the workspace instead"
                        ),
                    ))
                }
                other => Some(refuse(
                    &child,
                    format!("{}, not a regular file; only regular files are artifacts", kind(other)),
                )),
            };
            if let Some(found) = result {
                if !sink(found) {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

/// Opens the regular file `name` in `dir` for upload, checking the opened descriptor.
fn open_file(dir: &OwnedFd, name: &std::ffi::CStr, path: &str, max_file: u64) -> Found {
    let refuse = |reason: String| Found::Refused { path: path.to_string(), reason };
    if let Err(why) = check_path(path) {
        return refuse(why);
    }
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    let fd = match rustix::fs::openat(dir, name, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::LOOP) => return refuse("became a symbolic link while being read; links are never followed".into()),
        Err(e) => return refuse(format!("cannot be opened: {e}")),
    };
    let st = match rustix::fs::fstat(&fd) {
        Ok(st) => st,
        Err(e) => return refuse(format!("cannot be read: {e}")),
    };
    let t = FileType::from_raw_mode(st.st_mode);
    if t != FileType::RegularFile {
        return refuse(format!("became {} while being read; only regular files are artifacts", kind(t)));
    }
    let size = u64::try_from(st.st_size).unwrap_or(0);
    if size > max_file {
        return refuse(format!(
            "{} is over the per-file cap of {}; not uploaded",
            gpuci_core::quantity::Bytes(size),
            gpuci_core::quantity::Bytes(max_file)
        ));
    }
    Found::File { path: path.to_string(), file: std::fs::File::from(fd), size }
}

/// Creates the file `rel` in `workspace` for an artifact of an earlier step, making its
/// directories; a link or a file on the way is refused, never followed, and a file already
/// there (from the workspace upload) is replaced, a directory is not.
pub fn create_in(workspace: &Path, rel: &str) -> Result<std::fs::File, String> {
    check_path(rel)?;
    let root = rustix::fs::openat(CWD, workspace, dir_flags(), Mode::empty())
        .map_err(|e| format!("the workspace cannot be opened: {e}"))?;
    let comps: Vec<&str> = rel.split('/').collect();
    let (name, dirs) = comps.split_last().ok_or("the path is empty")?;
    let mut cur = rustix::fs::openat(&root, ".", dir_flags(), Mode::empty()).map_err(|e| e.to_string())?;
    let mut so_far = String::new();
    for comp in dirs {
        so_far = join(&so_far, comp);
        match rustix::fs::mkdirat(&cur, *comp, Mode::from_raw_mode(0o755)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(format!("making directory {so_far}: {e}")),
        }
        cur = rustix::fs::openat(&cur, *comp, dir_flags(), Mode::empty())
            .map_err(|e| format!("{so_far}: {}", not_a_dir(e)))?;
    }
    match rustix::fs::statat(&cur, *name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
            return Err("a directory is in its place in the workspace".into());
        }
        // A link is removed, not written through.
        Ok(_) => rustix::fs::unlinkat(&cur, *name, AtFlags::empty()).map_err(|e| format!("replacing it: {e}"))?,
        Err(_) => {}
    }
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd =
        rustix::fs::openat(&cur, *name, flags, Mode::from_raw_mode(0o644)).map_err(|e| format!("creating it: {e}"))?;
    Ok(std::fs::File::from(fd))
}

#[cfg(test)]
#[path = "artifacts_tests.rs"]
mod tests;
