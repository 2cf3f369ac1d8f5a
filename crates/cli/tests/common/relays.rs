//! TCP relays on loopback that play an address changing hands around a coordinator's identity
//! proof (`failover_urls.rs`): whoever holds a listed address after a proof must be sent
//! nothing.
#![allow(dead_code)] // each test binary uses some of them

/// Passes the first connection it takes on to `first` and every later one to `then` (both
/// `host:port`): an address that changed hands right after a coordinator proved its key on it.
pub fn address_changing_hands(ip: &str, first: String, then: String) -> String {
    let listener = std::net::TcpListener::bind((ip, 0)).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for (n, down) in listener.incoming().flatten().enumerate() {
            let Ok(up) = std::net::TcpStream::connect(if n == 0 { &first } else { &then }) else { continue };
            for (mut from, mut to) in [(down.try_clone().unwrap(), up.try_clone().unwrap()), (up, down)] {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            }
        }
    });
    addr
}

/// Passes every connection on to `to` (`host:port`), but the answer to the first
/// `POST /api/v1/pipelines` is never passed back: the connection closes once the coordinator
/// has answered it (a leader killed after it committed the pipeline, before its answer left),
/// or with `hold`, stays open and silent (a leader frozen just then).
pub fn losing_the_first_submit_answer(ip: &str, to: String, hold: bool) -> String {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, Ordering};
    let listener = std::net::TcpListener::bind((ip, 0)).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let lost_one = std::sync::Arc::new(AtomicBool::new(false));
    std::thread::spawn(move || {
        for down in listener.incoming().flatten() {
            let Ok(up) = std::net::TcpStream::connect(&to) else { continue };
            let losing = std::sync::Arc::new(AtomicBool::new(false));
            let (mut from, mut to_up, lost, this) =
                (down.try_clone().unwrap(), up.try_clone().unwrap(), lost_one.clone(), losing.clone());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    // Marked before the request goes on: its answer cannot come back first.
                    if buf[..n].starts_with(b"POST /api/v1/pipelines ") && !lost.swap(true, Ordering::SeqCst) {
                        this.store(true, Ordering::SeqCst);
                    }
                    if to_up.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = to_up.shutdown(std::net::Shutdown::Write);
            });
            let (mut from, mut to_down) = (up, down);
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    if losing.load(Ordering::SeqCst) && hold {
                        // Silent for good: the client's connection stays open, nothing comes.
                        let _ = std::io::copy(&mut from, &mut std::io::sink());
                        std::thread::sleep(std::time::Duration::from_secs(600));
                        return;
                    }
                    if losing.load(Ordering::SeqCst) {
                        let _ = to_down.shutdown(std::net::Shutdown::Both);
                        let _ = from.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                    if to_down.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = to_down.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    addr
}

/// Passes every connection on to `to`, and with `close_after_proof` closes each one once it has
/// passed back the answer to an identity proof (a coordinator killed right after it proved its
/// key). Notes each connection on which a credential came before any proof was asked.
pub fn closing_after_each_proof(
    ip: &str,
    to: String,
    close_after_proof: bool,
) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, Ordering};
    let listener = std::net::TcpListener::bind((ip, 0)).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let unproved: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let noted = unproved.clone();
    std::thread::spawn(move || {
        for down in listener.incoming().flatten() {
            let Ok(up) = std::net::TcpStream::connect(&to) else { continue };
            let asked = std::sync::Arc::new(AtomicBool::new(false));
            let (mut from, mut to_up, asked_up, noted) =
                (down.try_clone().unwrap(), up.try_clone().unwrap(), asked.clone(), noted.clone());
            std::thread::spawn(move || {
                let mut seen = String::new();
                let mut buf = vec![0u8; 64 << 10];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    seen.push_str(&String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase());
                    if seen.starts_with("get /api/v1/identity") {
                        asked_up.store(true, Ordering::SeqCst);
                    } else if seen.contains("\nauthorization:") {
                        noted.lock().unwrap().push(seen.lines().next().unwrap_or_default().to_string());
                    }
                    if to_up.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = to_up.shutdown(std::net::Shutdown::Write);
            });
            let (mut from, mut to_down) = (up, down);
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 || to_down.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    if close_after_proof && asked.load(Ordering::SeqCst) {
                        break;
                    }
                }
                let _ = to_down.shutdown(std::net::Shutdown::Both);
                let _ = from.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    (addr, unproved)
}
