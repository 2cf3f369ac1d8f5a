//! `gpuci artifacts download` against a coordinator whose download goes wrong: the bytes do
//! not match the artifact's sha256, or the body is cut off before its `Content-Length`.
//! Regression (outsider finding): the command exited 1 but left the bad or truncated file at
//! its path, and a rerun then refused because the file was there (without `--overwrite`).
//! Now nothing is left at the path (nor beside it), and a rerun downloads it whole.
//!
//! The coordinator is played by a small HTTP server of this test on 127.0.0.1 (the listing and
//! the download; everything else 404, which the CLI takes as a coordinator without an
//! identity key).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_protocol::api::ArtifactInfo;
use sha2::{Digest, Sha256};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

const BIN: &str = env!("CARGO_BIN_EXE_gpuci");

const WHOLE: u8 = 0;
/// Every byte there, one of them wrong.
const WRONG: u8 = 1;
/// Half the bytes, then the connection closes.
const CUT: u8 = 2;

const JOB: i64 = 7;
const PATH: &str = "dist/model.bin";

fn content() -> Vec<u8> {
    (0..200_000u32).map(|i| (i % 251) as u8).collect()
}

/// The fake coordinator; its mode says how the download goes.
fn serve() -> (String, Arc<AtomicU8>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let mode = Arc::new(AtomicU8::new(WHOLE));
    let m = mode.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let m = m.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn);
                let mut first = String::new();
                if reader.read_line(&mut first).is_err() {
                    return;
                }
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                        break;
                    }
                }
                let path = first.split(' ').nth(1).unwrap_or_default().to_string();
                let mut conn = reader.into_inner();
                let bytes = content();
                let send = |conn: &mut std::net::TcpStream, status: &str, length: usize, body: &[u8]| {
                    let head = format!(
                        "HTTP/1.1 {status}\r\nContent-Type: application/octet-stream\r\nContent-Length: {length}\r\n\
                         Connection: close\r\n\r\n"
                    );
                    let _ = conn.write_all(head.as_bytes());
                    let _ = conn.write_all(body);
                };
                if path == format!("/api/v1/jobs/{JOB}/artifacts") {
                    let list = vec![ArtifactInfo {
                        job_id: JOB,
                        path: PATH.into(),
                        size: bytes.len() as u64,
                        sha256: hex::encode(Sha256::digest(&bytes)),
                        created_at_ms: 1,
                        note: None,
                    }];
                    let json = serde_json::to_vec(&list).unwrap();
                    send(&mut conn, "200 OK", json.len(), &json);
                } else if path.starts_with(&format!("/api/v1/jobs/{JOB}/artifact?")) {
                    match m.load(Ordering::SeqCst) {
                        WHOLE => send(&mut conn, "200 OK", bytes.len(), &bytes),
                        WRONG => {
                            let mut wrong = bytes.clone();
                            wrong[0] ^= 0xff;
                            send(&mut conn, "200 OK", bytes.len(), &wrong);
                        }
                        _ => send(&mut conn, "200 OK", bytes.len(), &bytes[..bytes.len() / 2]),
                    }
                } else {
                    let json = br#"{"error":"not found"}"#;
                    send(&mut conn, "404 Not Found", json.len(), json);
                }
            });
        }
    });
    (url, mode)
}

fn download(url: &str, home: &std::path::Path, dest: &std::path::Path) -> std::process::Output {
    std::process::Command::new(BIN)
        .args(["artifacts", "download", &JOB.to_string(), "--dir", dest.to_str().unwrap()])
        .env("GPUCI_SERVER", url)
        .env("GPUCI_TOKEN", "token-for-the-test")
        // No identity key from the machine's own data dir.
        .env("GPUCI_DATA_DIR", home)
        .output()
        .unwrap()
}

#[test]
fn a_download_that_does_not_match_or_is_cut_off_leaves_no_file_and_a_rerun_gets_it_whole() {
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("dl");
    let (url, mode) = serve();
    for (what, m) in [("wrong bytes", WRONG), ("a cut-off body", CUT)] {
        mode.store(m, Ordering::SeqCst);
        let out = download(&url, dir.path(), &dest);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{what}: {stderr}");
        assert!(stderr.contains(PATH), "{what}: the message names the artifact: {stderr}");
        assert!(!dest.join(PATH).exists(), "{what}: a bad file was left at its path");
        let left: Vec<_> = std::fs::read_dir(dest.join("dist")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.is_empty(), "{what}: files left beside it: {left:?}");
        assert!(out.stdout.is_empty(), "{what}: a path was reported written");
    }
    // A rerun needs no --overwrite: nothing of the failed tries is there.
    mode.store(WHOLE, Ordering::SeqCst);
    let out = download(&url, dir.path(), &dest);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(dest.join(PATH)).unwrap(), content());
}
