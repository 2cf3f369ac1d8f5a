//! Cloud instance metadata services, kept out of a slot's network namespace.
//!
//! Why: pasta forwards a job's connection from the host's own network stack, so a job in a
//! slot network reached `169.254.169.254` exactly as the agent would: IMDSv1 GETs and the
//! IMDSv2 token PUT both answered (the IMDS hop limit does not help, pasta is the client), and
//! on a cloud fleet machine with an instance profile any job (a fork's approved pull request
//! included) read the instance role's credentials. GCP's, Azure's and others' metadata servers
//! were reached the same way (an outsider found).
//!
//! How: routing-policy rules in the slot's network namespace, one per range in [`DENIED`],
//! with the `prohibit` action and a preference ([`PREFERENCE`]) ahead of the main table, so
//! the kernel answers a connection to those addresses with `EACCES` before any route is looked
//! up and before pasta sees a packet. Rules, not routes: a more specific route that pasta copies
//! from the host (some images route `169.254.169.254/32` via the primary interface) would win
//! over a `/16` route, while no route wins over a rule.
//!
//! Why the job cannot undo them: the namespace belongs to a user namespace the job is not in
//! (see `netns.rs`), so the job holds no `CAP_NET_ADMIN` over it. The rules are added by the
//! agent (root, from a thread that joined the namespace), before the first job of the slot,
//! and the slot is refused when they cannot be added: a job never runs in a namespace without
//! them unless the operator allowed it for trusted origins ([`SlotNetwork::set_metadata`]).
//!
//! [`SlotNetwork::set_metadata`]: crate::SlotNetwork::set_metadata

use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

/// Destinations no job may reach by default: link-local IPv4 (AWS, GCP, Azure, Oracle,
/// OpenStack and DigitalOcean metadata at `169.254.169.254`, ECS task credentials at
/// `169.254.170.2`, AWS's DNS and time at `169.254.169.253`/`.123`), Alibaba Cloud's
/// `100.100.100.200`, Azure's WireServer `168.63.129.16` (goal state and extension settings;
/// outsider finding), and the IPv6 metadata addresses of AWS (`fd00:ec2::254`, and the EKS
/// Pod Identity agent's `fd00:ec2::23`), GCP
/// (`fd20:ce::254`) and Oracle (`fd00:c1::a9fe:a9fe`). An IPv4-mapped IPv6 address
/// (`::ffff:169.254.169.254`) is routed as IPv4 and meets the IPv4 rule.
///
/// The trap: a host whose resolver is the Amazon DNS server's link-local address
/// (`169.254.169.253` in `/etc/resolv.conf`, rare: most images name the VPC's `.2` address
/// or a local stub) leaves its jobs without DNS (docs/sandbox.md says what to do).
pub const DENIED: &[(&str, u8)] = &[
    ("169.254.0.0", 16),
    ("100.100.100.200", 32),
    ("168.63.129.16", 32),
    ("fd00:ec2::254", 128),
    ("fd00:ec2::23", 128),
    ("fd20:ce::254", 128),
    ("fd00:c1::a9fe:a9fe", 128),
];

/// Where the rules sit: after `local` (0), before `main` (32766) and `default` (32767).
pub const PREFERENCE: u32 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    #[error("joining the slot's network namespace: {0}")]
    Join(std::io::Error),
    #[error("netlink: {0}")]
    Netlink(std::io::Error),
    #[error("the kernel refused the rule for {range}: {source}")]
    Refused { range: String, source: std::io::Error },
}

// From <linux/rtnetlink.h>, <linux/fib_rules.h> and <linux/netlink.h>.
const RTM_NEWRULE: u16 = 32;
const RTM_DELRULE: u16 = 33;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 2;
const FRA_DST: u16 = 1;
const FRA_PRIORITY: u16 = 6;
const FR_ACT_PROHIBIT: u8 = 8;
const RT_TABLE_UNSPEC: u8 = 0;

/// One `RTM_NEWRULE` (or `RTM_DELRULE`) request: `nlmsghdr`, `fib_rule_hdr`, then the
/// destination and the preference as attributes. Plain bytes, so the encoding can be tested
/// against what `ip rule` would send without a namespace.
pub(crate) fn rule_message(add: bool, dst: IpAddr, prefix: u8, seq: u32) -> Vec<u8> {
    let (family, addr): (u8, Vec<u8>) = match dst {
        IpAddr::V4(a) => (libc::AF_INET as u8, a.octets().to_vec()),
        IpAddr::V6(a) => (libc::AF_INET6 as u8, a.octets().to_vec()),
    };
    let mut body = vec![family, prefix, 0, 0, RT_TABLE_UNSPEC, 0, 0, FR_ACT_PROHIBIT];
    body.extend_from_slice(&0u32.to_ne_bytes()); // flags
    attribute(&mut body, FRA_DST, &addr);
    attribute(&mut body, FRA_PRIORITY, &PREFERENCE.to_ne_bytes());
    let (kind, flags) = if add {
        (RTM_NEWRULE, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL)
    } else {
        (RTM_DELRULE, NLM_F_REQUEST | NLM_F_ACK)
    };
    let mut msg = Vec::with_capacity(16 + body.len());
    msg.extend_from_slice(&(16 + body.len() as u32).to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(&flags.to_ne_bytes());
    msg.extend_from_slice(&seq.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
    msg.extend(body);
    msg
}

/// A netlink attribute (`rtattr`), padded to 4 bytes.
fn attribute(out: &mut Vec<u8>, kind: u16, data: &[u8]) {
    let len = 4 + data.len() as u16;
    out.extend_from_slice(&len.to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(data);
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

/// The errno of a netlink acknowledgement (`NLMSG_ERROR` with 0 for success) for `seq`.
pub(crate) fn ack_errno(reply: &[u8], seq: u32) -> Option<i32> {
    let mut rest = reply;
    while rest.len() >= 20 {
        let len = u32::from_ne_bytes(rest[0..4].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(rest[4..6].try_into().ok()?);
        let got_seq = u32::from_ne_bytes(rest[8..12].try_into().ok()?);
        if len < 16 || len > rest.len() {
            return None;
        }
        if kind == NLMSG_ERROR && got_seq == seq {
            return Some(-i32::from_ne_bytes(rest[16..20].try_into().ok()?));
        }
        rest = &rest[(len + 3) & !3..];
    }
    None
}

/// The ranges of [`DENIED`], parsed.
fn denied() -> impl Iterator<Item = (IpAddr, u8, &'static str)> {
    DENIED.iter().filter_map(|(a, p)| a.parse().ok().map(|ip| (ip, *p, *a)))
}

/// Adds (`deny = true`) or removes the rules in the network namespace `netns`. Needs
/// `CAP_SYS_ADMIN` to join it and `CAP_NET_ADMIN` over it (a root agent has both). Adding
/// a rule that is there already, or removing one that is not, is no error: the call is
/// idempotent, so a pass after a half-finished one completes it.
pub(crate) fn set_denied(netns: &OwnedFd, deny: bool) -> Result<(), MetadataError> {
    let ns = netns.try_clone().map_err(MetadataError::Join)?;
    // A thread of its own joins the namespace and ends with it: no other thread of the
    // agent ever runs in the slot's network.
    std::thread::spawn(move || apply(&ns, deny))
        .join()
        .unwrap_or_else(|_| Err(MetadataError::Netlink(std::io::Error::other("the netlink thread panicked"))))
}

fn apply(ns: &OwnedFd, deny: bool) -> Result<(), MetadataError> {
    use nix::sys::socket::{recv, send, socket, AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType};
    nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| MetadataError::Join(e.into()))?;
    let sock = socket(AddressFamily::Netlink, SockType::Raw, SockFlag::SOCK_CLOEXEC, SockProtocol::NetlinkRoute)
        .map_err(|e| MetadataError::Netlink(e.into()))?;
    nix::sys::socket::bind(sock.as_raw_fd(), &nix::sys::socket::NetlinkAddr::new(0, 0))
        .map_err(|e| MetadataError::Netlink(e.into()))?;
    let mut buf = vec![0u8; 8192];
    for (seq, (ip, prefix, range)) in (1u32..).zip(denied()) {
        let msg = rule_message(deny, ip, prefix, seq);
        send(sock.as_raw_fd(), &msg, MsgFlags::empty()).map_err(|e| MetadataError::Netlink(e.into()))?;
        let errno = loop {
            let n =
                recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(|e| MetadataError::Netlink(e.into()))?;
            if let Some(errno) = ack_errno(&buf[..n], seq) {
                break errno;
            }
        };
        let fine = errno == 0 || (deny && errno == libc::EEXIST) || (!deny && errno == libc::ENOENT);
        if !fine {
            return Err(MetadataError::Refused {
                range: format!("{range}/{prefix}"),
                source: std::io::Error::from_raw_os_error(errno),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_denied_range_parses_and_has_a_sane_prefix() {
        assert_eq!(denied().count(), DENIED.len());
        for (ip, prefix, range) in denied() {
            let max = if ip.is_ipv4() { 32 } else { 128 };
            assert!(prefix <= max, "{range}/{prefix}");
        }
    }

    #[test]
    fn a_rule_request_is_laid_out_as_the_kernel_reads_it() {
        let m = rule_message(true, "169.254.0.0".parse().unwrap(), 16, 7);
        // nlmsghdr (16) + fib_rule_hdr (12) + FRA_DST (8) + FRA_PRIORITY (8)
        assert_eq!(m.len(), 44);
        assert_eq!(u32::from_ne_bytes(m[0..4].try_into().unwrap()), 44);
        assert_eq!(u16::from_ne_bytes(m[4..6].try_into().unwrap()), RTM_NEWRULE);
        assert_eq!(u32::from_ne_bytes(m[8..12].try_into().unwrap()), 7);
        assert_eq!(&m[16..24], &[libc::AF_INET as u8, 16, 0, 0, 0, 0, 0, FR_ACT_PROHIBIT]);
        assert_eq!(&m[28..36], &[8, 0, 1, 0, 169, 254, 0, 0]);
        let v6 = rule_message(false, "fd00:ec2::254".parse().unwrap(), 128, 1);
        assert_eq!(v6.len(), 16 + 12 + 20 + 8);
        assert_eq!(u16::from_ne_bytes(v6[4..6].try_into().unwrap()), RTM_DELRULE);
    }

    #[test]
    fn acknowledgements_are_read_by_sequence() {
        let mut ack = Vec::new();
        ack.extend_from_slice(&36u32.to_ne_bytes());
        ack.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        ack.extend_from_slice(&0u16.to_ne_bytes());
        ack.extend_from_slice(&3u32.to_ne_bytes());
        ack.extend_from_slice(&0u32.to_ne_bytes());
        ack.extend_from_slice(&(-libc::EEXIST).to_ne_bytes());
        ack.extend_from_slice(&[0u8; 16]);
        assert_eq!(ack_errno(&ack, 3), Some(libc::EEXIST));
        assert_eq!(ack_errno(&ack, 4), None);
        assert_eq!(ack_errno(&ack[..10], 3), None);
    }
}
