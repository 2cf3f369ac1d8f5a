//! Hostile workspaces against [`collect`] and [`create_in`].
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use super::*;
use std::io::{Read, Write};
use std::os::unix::fs::symlink;

fn pats(p: &[&str]) -> Patterns {
    Patterns::new(&p.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
}

/// (path, contents) of the files found, and (path, reason) of the refusals.
type Walked = (Vec<(String, Vec<u8>)>, Vec<(String, String)>);

fn run(ws: &Path, p: &[&str], max_file: u64) -> Walked {
    let (mut files, mut refused) = (Vec::new(), Vec::new());
    collect(ws, &pats(p), max_file, |f| {
        match f {
            Found::File { path, mut file, size } => {
                let mut buf = Vec::new();
                (&mut file).take(size).read_to_end(&mut buf).unwrap();
                files.push((path, buf));
            }
            Found::Refused { path, reason } => refused.push((path, reason)),
        }
        true
    })
    .unwrap();
    files.sort();
    refused.sort();
    (files, refused)
}

fn write(ws: &Path, rel: &str, data: &[u8]) {
    let p = ws.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::File::create(p).unwrap().write_all(data).unwrap();
}

#[test]
fn regular_files_are_found_by_glob_and_others_left_alone() {
    let d = tempfile::tempdir().unwrap();
    let ws = d.path();
    write(ws, "dist/a.whl", b"wheel");
    write(ws, "dist/sub/b.whl", b"deep");
    write(ws, "dist/notes.txt", b"no");
    write(ws, "logs/x/y/z.log", b"log");
    write(ws, "secret.env", b"TOKEN=1");
    let (files, refused) = run(ws, &["dist/*.whl", "logs/**"], 1 << 20);
    assert_eq!(
        files,
        [("dist/a.whl".into(), b"wheel".to_vec()), ("logs/x/y/z.log".into(), b"log".to_vec())],
        "`*` stays in one directory, `**` crosses them"
    );
    assert!(refused.is_empty(), "{refused:?}");
}

#[test]
fn a_symlink_to_etc_is_refused_and_nothing_outside_is_read() {
    let d = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("shadow"), b"root:SECRET").unwrap();
    let ws = d.path();
    std::fs::create_dir(ws.join("out")).unwrap();
    symlink("/etc", ws.join("out/etc")).unwrap();
    symlink(outside.path().join("shadow"), ws.join("out/shadow")).unwrap();
    // The base of a pattern itself a link: `report/*` where report -> outside.
    symlink(outside.path(), ws.join("report")).unwrap();
    let (files, refused) = run(ws, &["out/**", "report/*"], 1 << 30);
    assert!(files.is_empty(), "{files:?}");
    let reasons: Vec<&str> = refused.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(reasons, ["out/etc", "out/shadow", "report"]);
    assert!(refused[0].1.contains("symbolic link") && refused[0].1.contains("/etc"), "{refused:?}");
    assert!(refused[2].1.contains("links are never followed"), "{refused:?}");
}

#[test]
fn a_symlink_loop_ends_the_walk_without_following() {
    let d = tempfile::tempdir().unwrap();
    let ws = d.path();
    std::fs::create_dir(ws.join("a")).unwrap();
    symlink("../a", ws.join("a/loop")).unwrap();
    symlink("self", ws.join("a/self")).unwrap();
    write(ws, "a/real.txt", b"ok");
    let (files, refused) = run(ws, &["**"], 1 << 20);
    assert_eq!(files, [("a/real.txt".into(), b"ok".to_vec())]);
    assert_eq!(refused.iter().map(|(p, _)| p.as_str()).collect::<Vec<_>>(), ["a/loop", "a/self"]);
}

#[test]
fn dotdot_in_a_glob_never_compiles() {
    for p in ["../*", "out/../../etc/*", "/etc/*"] {
        let e = Patterns::new(&[p.to_string()]).unwrap_err();
        assert!(e.contains(p), "{e}");
    }
}

#[test]
fn a_fifo_is_refused_without_hanging() {
    let d = tempfile::tempdir().unwrap();
    let ws = d.path();
    nix::unistd::mkfifo(&ws.join("pipe.log"), nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
    let (files, refused) = run(ws, &["*.log"], 1 << 20);
    assert!(files.is_empty());
    assert_eq!(refused.len(), 1);
    assert!(refused[0].1.contains("named pipe"), "{refused:?}");
}

#[test]
fn a_device_node_is_refused_when_root_can_make_one() {
    let d = tempfile::tempdir().unwrap();
    let ws = d.path();
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    // /dev/zero's numbers: reading it would never end.
    if mknod(&ws.join("zero.bin"), SFlag::S_IFCHR, Mode::from_bits_truncate(0o666), makedev(1, 5)).is_err() {
        eprintln!("skipped: cannot make a device node here (not root)");
        return;
    }
    let (files, refused) = run(ws, &["*.bin"], 1 << 20);
    assert!(files.is_empty());
    assert!(refused[0].1.contains("a device file"), "{refused:?}");
}

#[test]
fn a_sparse_file_over_the_cap_is_refused_unread() {
    let d = tempfile::tempdir().unwrap();
    let ws = d.path();
    let f = std::fs::File::create(ws.join("huge.bin")).unwrap();
    f.set_len(2 << 30).unwrap();
    write(ws, "small.bin", b"1234");
    let started = std::time::Instant::now();
    let (files, refused) = run(ws, &["*.bin"], 1 << 30);
    assert_eq!(files, [("small.bin".into(), b"1234".to_vec())]);
    assert_eq!(refused[0].0, "huge.bin");
    assert!(refused[0].1.contains("per-file cap of 1 GiB"), "{refused:?}");
    assert!(started.elapsed() < std::time::Duration::from_secs(20), "the 2 GiB were not read");
}

#[test]
fn a_name_with_a_newline_is_refused_with_the_reason() {
    let d = tempfile::tempdir().unwrap();
    let ws = d.path();
    write(ws, "ok.txt", b"fine");
    write(ws, "evil\n[gpuci] forged line.txt", b"x");
    let (files, refused) = run(ws, &["*.txt"], 1 << 20);
    assert_eq!(files, [("ok.txt".into(), b"fine".to_vec())]);
    assert_eq!(refused.len(), 1);
    assert!(refused[0].1.contains("control character"), "{refused:?}");
}

#[test]
fn a_very_deep_tree_is_cut_at_the_depth_limit() {
    let d = tempfile::tempdir().unwrap();
    let ws = d.path();
    let deep: String = (0..MAX_DEPTH + 5).map(|_| "d").collect::<Vec<_>>().join("/");
    std::fs::create_dir_all(ws.join(&deep)).unwrap();
    let (files, refused) = run(ws, &["**"], 1 << 20);
    assert!(files.is_empty());
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(refused[0].1.contains("deeper than"), "{refused:?}");
}

#[test]
fn create_in_never_writes_through_a_link() {
    let d = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let ws = d.path();
    symlink(outside.path(), ws.join("dist")).unwrap();
    let e = create_in(ws, "dist/a.whl").unwrap_err();
    assert!(e.contains("dist") && e.contains("never followed"), "{e}");
    assert!(std::fs::read_dir(outside.path()).unwrap().next().is_none(), "nothing written outside");
    // A link in the file's own place is replaced, not written through.
    std::fs::write(outside.path().join("target"), b"keep").unwrap();
    symlink(outside.path().join("target"), ws.join("file.txt")).unwrap();
    create_in(ws, "file.txt").unwrap().write_all(b"new").unwrap();
    assert_eq!(std::fs::read(outside.path().join("target")).unwrap(), b"keep");
    assert_eq!(std::fs::read(ws.join("file.txt")).unwrap(), b"new");
    assert!(!std::fs::symlink_metadata(ws.join("file.txt")).unwrap().file_type().is_symlink());
    // Paths that would leave are refused before anything is touched.
    for bad in ["../x", "/etc/passwd", "a/../../x", "a\nb"] {
        assert!(create_in(ws, bad).is_err(), "{bad:?}");
    }
    create_in(ws, "new/dir/f.bin").unwrap().write_all(b"f").unwrap();
    assert_eq!(std::fs::read(ws.join("new/dir/f.bin")).unwrap(), b"f");
}
