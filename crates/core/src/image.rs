//! Container image references: what an `image:` may name.
//!
//! Only a registry reference (`[host[:port]/]path[:tag][@digest]`, the grammar of the
//! distribution spec), never a transport: `oci-archive:`, `docker-archive:`, `dir:` or
//! `containers-storage:` made the agent's root engine open any host path the job named (a
//! file-existence oracle, and a gzip bomb unpacked onto the host's disk), and a reference that
//! begins with `-` is an option. Checked when a pipeline is parsed and again before the engine
//! is run.

/// Transports podman and skopeo know (`containers-image` `transports`).
const TRANSPORTS: &[&str] = &[
    "containers-storage",
    "dir",
    "docker",
    "docker-archive",
    "docker-daemon",
    "oci",
    "oci-archive",
    "ostree",
    "sif",
    "tarball",
];

/// Why `s` is not an image reference, or `Ok`.
pub fn check_reference(s: &str) -> Result<(), String> {
    let bad = |why: &str| {
        Err(format!("{why}; expected a registry image reference like \"ubuntu:24.04\" or \"ghcr.io/org/img:tag\""))
    };
    if s.is_empty() || s.len() > 512 {
        return bad("empty or longer than 512 characters");
    }
    // Grammatically `containers-storage:alpine` is image `containers-storage`, tag `alpine`;
    // an engine reads it as a transport.
    if let Some((first, _)) = s.split_once(':') {
        if TRANSPORTS.contains(&first) {
            return bad(&format!("`{first}:` is a transport, not an image"));
        }
    }
    let (name_tag, digest) = match s.split_once('@') {
        Some((n, d)) => (n, Some(d)),
        None => (s, None),
    };
    if let Some(d) = digest {
        let Some((algo, hex)) = d.split_once(':') else { return bad("a digest is ALGORITHM:HEX") };
        let algo_ok = !algo.is_empty()
            && algo.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+._-".contains(&b));
        if !algo_ok || hex.len() < 32 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return bad("not a valid digest");
        }
    }
    // The tag is after the last ':' that follows the last '/'.
    let last_slash = name_tag.rfind('/');
    let (name, tag) = match name_tag.rfind(':') {
        Some(i) if last_slash.is_none_or(|j| i > j) => (&name_tag[..i], Some(&name_tag[i + 1..])),
        _ => (name_tag, None),
    };
    if let Some(t) = tag {
        let first_ok = t.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !first_ok || t.len() > 128 || !t.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b)) {
            return bad("not a valid tag");
        }
    }
    let mut parts: Vec<&str> = name.split('/').collect();
    if parts.len() > 1 && (parts[0].contains(['.', ':']) || parts[0] == "localhost") {
        let host = parts.remove(0);
        let (h, port) = match host.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (host, None),
        };
        let host_ok = !h.is_empty()
            && h.split('.').all(|l| {
                !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') && !l.starts_with('-')
            });
        let port_ok = port.is_none_or(|p| !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()));
        if !host_ok || !port_ok {
            return bad("not a valid registry host");
        }
    }
    for p in &parts {
        if !path_component(p) {
            return bad(&format!("{p:?} is not a valid name component (lowercase letters, digits, separators)"));
        }
    }
    Ok(())
}

/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*`
fn path_component(p: &str) -> bool {
    let b = p.as_bytes();
    if b.is_empty() || !is_alnum(b[0]) || !is_alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if is_alnum(b[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && !is_alnum(b[i]) {
            i += 1;
        }
        let sep = &p[start..i];
        if !(sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|c| c == b'-')) {
            return false;
        }
    }
    true
}

fn is_alnum(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_references_pass() {
        for ok in [
            "ubuntu",
            "ubuntu:24.04",
            "python:3.12-slim",
            "nvcr.io/nvidia/pytorch:24.05-py3",
            "ghcr.io/org/sub/img:v1.2_3",
            "localhost/gpuci-test:busybox",
            "localhost:5000/x/y:latest",
            "registry.example.com:443/team/cuda",
            "library/my_img__x--y.z",
            "alpine@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "alpine:3@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
        ] {
            assert_eq!(check_reference(ok), Ok(()), "{ok}");
        }
    }

    /// Regression (outsider attack): transports made the root engine open host paths.
    #[test]
    fn transports_options_and_malformed_names_are_refused() {
        for bad in [
            "docker-archive:/etc/shadow",
            "oci-archive:/tmp/work/slot-0/job-3/bomb.tar.gz",
            "dir:/root",
            "containers-storage:alpine",
            "docker://alpine",
            "oci:/tmp/x",
            "--privileged",
            "-v",
            "Ubuntu",
            "ubuntu:",
            "ubuntu:-x",
            "a//b",
            "/abs",
            "evil.invalid:/x",
            "ubuntu@sha256:xyz",
            "",
        ] {
            assert!(check_reference(bad).is_err(), "{bad} passed");
        }
    }
}
