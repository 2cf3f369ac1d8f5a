//! What the agent writes into a waiting shell's pipe at the hand-over: one `{ ...; }` block
//! that the shell parses whole before running any of it, every word single-quoted, the job's
//! values never on an argument vector (see the parent module's header for why).

use std::collections::BTreeMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use super::HANDOVER;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// `{ exec 'BWRAP' --args N -- 'ARG'... </dev/null; }` and a newline: one compound
/// command, which the shell only runs once it has read all of it. The job's stdin is
/// `/dev/null`, as in a cold start, not the pipe.
pub(crate) fn command_line(bwrap: &std::path::Path, args_fd: i32, argv: &[String]) -> Vec<u8> {
    let mut s = b"{ exec ".to_vec();
    quote(&mut s, bwrap.as_os_str().as_bytes());
    s.extend_from_slice(format!(" --args {args_fd} --").as_bytes());
    for a in argv {
        s.push(b' ');
        quote(&mut s, a.as_bytes());
    }
    s.extend_from_slice(b" </dev/null");
    s.extend_from_slice(b"; }\n");
    s
}

/// The ready sandbox's command: `{ export K='V'...; exec 'ENV' -u N... -- 'ARG'... </dev/null; }`
/// and a newline. The values go through the shell's memory, never an argument vector (see the
/// module header). The shell inside started with no environment, so after the exports its
/// environment is the job's plus what the shell adds by itself, which `-u` removes; `env` then
/// looks `argv[0]` up on the job's `PATH` as bwrap's `execvp` does. Every name must pass
/// [`shell_safe_name`] and `argv[0]` must not hold `=` (both checked before, by `misfit`).
pub(crate) fn ready_command(env_program: &Path, env: &BTreeMap<String, String>, argv: &[String]) -> Vec<u8> {
    let mut s = b"{ ".to_vec();
    for (k, v) in env {
        debug_assert!(shell_safe_name(k));
        s.extend_from_slice(b"export ");
        s.extend_from_slice(k.as_bytes());
        s.push(b'=');
        quote(&mut s, v.as_bytes());
        s.extend_from_slice(b" || exit 126; ");
    }
    s.extend_from_slice(b"exec ");
    quote(&mut s, env_program.as_os_str().as_bytes());
    for added in SHELL_ADDED {
        if !env.contains_key(*added) {
            s.extend_from_slice(b" -u ");
            s.extend_from_slice(added.as_bytes());
        }
    }
    s.extend_from_slice(b" --");
    for a in argv {
        s.push(b' ');
        quote(&mut s, a.as_bytes());
    }
    s.extend_from_slice(b" </dev/null; }\n");
    s
}

/// What a POSIX shell may put into the environment of a command it execs without being
/// asked: dash and bash `PWD`, bash `SHLVL` (and `_`, `OLDPWD` after a `cd`), busybox's `ash` a
/// default `PATH`. None may be in a job's environment that it did not set itself.
const SHELL_ADDED: &[&str] = &["PWD", "OLDPWD", "SHLVL", "_", "PATH"];

/// Whether `export NAME=...` sets `NAME` to exactly the value given, in any `/bin/sh` a host
/// may have (dash, bash, busybox ash), and the shell adds nothing of its own under it: a
/// plain identifier, none of the names those shells read, compute or protect (`OPTIND` must be
/// a number in dash, `UID` and `SHELLOPTS` are read-only in bash, `RANDOM` and `SECONDS`
/// change as they are read, `PWD` and `SHLVL` are rewritten), and nothing of bash's own
/// prefixes. A job with any other name starts from the waiting shell (bwrap's `--setenv`
/// takes every name), so this list may be long without harm: it only costs such a job the
/// ready sandbox's head start.
pub(crate) fn shell_safe_name(name: &str) -> bool {
    const SPECIAL: &[&str] = &[
        "CDPATH",
        "COLUMNS",
        "DIRSTACK",
        "ENV",
        "EPOCHREALTIME",
        "EPOCHSECONDS",
        "EUID",
        "FUNCNAME",
        "GLOBIGNORE",
        "GROUPS",
        "HISTCMD",
        "HISTFILE",
        "HISTSIZE",
        "HOSTNAME",
        "HOSTTYPE",
        "IFS",
        "LINENO",
        "LINES",
        "MACHTYPE",
        "MAIL",
        "MAILCHECK",
        "MAILPATH",
        "OLDPWD",
        "OPTARG",
        "OPTERR",
        "OPTIND",
        "OSTYPE",
        "PIPESTATUS",
        "POSIXLY_CORRECT",
        "PPID",
        "PROMPT_COMMAND",
        "PS0",
        "PS1",
        "PS2",
        "PS3",
        "PS4",
        "PWD",
        "RANDOM",
        "SECONDS",
        "SHELLOPTS",
        "SHLVL",
        "SRANDOM",
        "TMOUT",
        "UID",
        "_",
    ];
    let mut bytes = name.bytes();
    let first_ok = bytes.next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
    first_ok
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !SPECIAL.contains(&name)
        && !["BASH", "COMP_", "READLINE_"].iter().any(|p| name.starts_with(p))
}

/// Single quotes keep every byte literal; a quote itself is closed, escaped and reopened.
fn quote(out: &mut Vec<u8>, word: &[u8]) {
    out.push(b'\'');
    for &b in word {
        if b == b'\'' {
            out.extend_from_slice(b"'\\''");
        } else {
            out.push(b);
        }
    }
    out.push(b'\'');
}

/// Writes the whole command without blocking the caller for long: the shell is waiting on
/// the other end, so anything longer than [`HANDOVER`] means it is gone or stuck.
pub(crate) fn hand_over(control: &OwnedFd, command: &[u8]) -> std::io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    fcntl(control.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK))?;
    let deadline = std::time::Instant::now() + HANDOVER;
    let mut rest = command;
    while !rest.is_empty() {
        match nix::unistd::write(control.as_fd(), rest) {
            Ok(n) => rest = &rest[n..],
            Err(nix::errno::Errno::EAGAIN) => {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the waiting process took no command",
                    ));
                }
                let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
                let mut fds = [PollFd::new(control.as_fd(), PollFlags::POLLOUT)];
                poll(&mut fds, PollTimeout::from(ms))?;
            }
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::process::Stdio;

    #[test]
    fn the_command_line_keeps_every_word_whole() {
        let argv = vec!["bash".to_string(), "-c".to_string(), "echo 'it''s' \"$HOME\" `id` ; }\nrm -rf /".to_string()];
        let line = command_line(std::path::Path::new("/usr/bin/bwrap"), 7, &argv);
        let text = String::from_utf8(line.clone()).expect("utf-8");
        assert!(text.starts_with("{ exec '/usr/bin/bwrap' --args 7 -- 'bash' '-c' "), "{text}");
        assert!(text.ends_with(" </dev/null; }\n"), "{text}");
        // What the shell makes of it: each word exactly as given.
        let probe = String::from_utf8(line)
            .unwrap()
            .replace("exec '/usr/bin/bwrap' --args 7 --", "printf '%s\\0'")
            .replace(" </dev/null", "");
        let out = std::process::Command::new("/bin/sh").arg("-c").arg(&probe).output().expect("sh");
        let words: Vec<&[u8]> = out.stdout.split(|b| *b == 0).filter(|w| !w.is_empty()).collect();
        assert_eq!(words, argv.iter().map(|a| a.as_bytes()).collect::<Vec<_>>());
    }

    #[test]
    fn a_command_cut_short_runs_nothing() {
        let argv = vec!["sh".to_string(), "-c".to_string(), "touch \"$0\"".to_string()];
        let dir = tempfile::tempdir().expect("tempdir");
        let marker = dir.path().join("ran");
        let mut argv2 = argv.clone();
        argv2.push(marker.display().to_string());
        let line = command_line(std::path::Path::new("/usr/bin/env"), 0, &argv2);
        let line = String::from_utf8(line).unwrap().replace(" --args 0 --", "");
        // Every cut but the whole line must run nothing.
        for cut in 1..line.len() - 1 {
            let part = &line.as_bytes()[..cut];
            let _ = std::process::Command::new("/bin/sh")
                .arg("-c")
                .arg(std::ffi::OsStr::from_bytes(part))
                .stderr(Stdio::null())
                .status();
            assert!(!marker.exists(), "a command cut at {cut} ran: {:?}", String::from_utf8_lossy(part));
        }
        std::process::Command::new("/bin/sh").arg("-c").arg(&line).status().expect("sh");
        assert!(marker.exists(), "the whole command should run");
    }

    /// What `/bin/sh -s` with no environment does with `ready_command(env, argv)` on its stdin.
    fn run_ready_command(command: &[u8]) -> std::process::Output {
        run_ready_command_in(&["/bin/sh"], command)
    }

    /// As [`run_ready_command`], with another shell (`["busybox", "sh"]`).
    fn run_ready_command_in(shell: &[&str], command: &[u8]) -> std::process::Output {
        let mut child = std::process::Command::new(shell[0])
            .args(&shell[1..])
            .arg("-s")
            .env_clear()
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("sh");
        child.stdin.take().expect("stdin").write_all(command).expect("write");
        child.wait_with_output().expect("wait")
    }

    #[test]
    fn the_ready_command_gives_exactly_the_jobs_environment_and_argv_in_every_shell() {
        let env = BTreeMap::from([
            ("PATH".to_string(), "/usr/bin:/bin".to_string()),
            ("QUOTES".to_string(), "it's \"$HOME\" `id` $(id) ; } exec true".to_string()),
            ("MULTI".to_string(), "one\ntwo\n; }\nrm -rf /".to_string()),
            ("EMPTY".to_string(), String::new()),
            ("_under_score9".to_string(), "x=y=z".to_string()),
            ("HOME".to_string(), "/nonexistent".to_string()),
        ]);
        let argv = ["env".to_string(), "-0".to_string()];
        let mut shells: Vec<Vec<&str>> = vec![vec!["/bin/sh"]];
        for extra in [vec!["/bin/dash"], vec!["/bin/bash"], vec!["/bin/busybox", "sh"]] {
            if Path::new(extra[0]).exists() {
                shells.push(extra);
            }
        }
        for shell in shells {
            let out = run_ready_command_in(&shell, &ready_command(Path::new("/usr/bin/env"), &env, &argv));
            assert!(out.status.success(), "{shell:?}: {}", String::from_utf8_lossy(&out.stderr));
            let mut got: Vec<(String, String)> = out
                .stdout
                .split(|b| *b == 0)
                .filter(|kv| !kv.is_empty())
                .map(|kv| {
                    let kv = String::from_utf8(kv.to_vec()).expect("utf-8");
                    let (k, v) = kv.split_once('=').expect("k=v");
                    (k.to_string(), v.to_string())
                })
                .collect();
            got.sort();
            let want: Vec<_> = env.clone().into_iter().collect();
            assert_eq!(got, want, "{shell:?}: the job's environment is exactly its own, nothing added");
        }
        // Without a PATH of its own, the job gets none (busybox would add one).
        let bare = BTreeMap::from([("A".to_string(), "1".to_string())]);
        let out = run_ready_command(&ready_command(Path::new("/usr/bin/env"), &bare, &["/usr/bin/env".to_string()]));
        assert_eq!(String::from_utf8_lossy(&out.stdout), "A=1\n");
    }

    #[test]
    fn the_ready_command_holds_no_value_outside_the_exports_and_names_are_shell_safe() {
        // The regression: every value was an argument of `env` until it exec'd the job.
        let env = BTreeMap::from([("TOKEN".to_string(), "s3cr3t-value".to_string())]);
        let line = ready_command(Path::new("/usr/bin/env"), &env, &["true".to_string()]);
        let text = String::from_utf8(line).expect("utf-8");
        let exec_part = text.split("exec ").nth(1).expect("an exec");
        assert!(!exec_part.contains("s3cr3t"), "a value reached exec's arguments: {text}");
        for bad in ["OPTIND", "UID", "A.B-C", "-i", "1X", "", "PWD", "SHLVL", "_", "IFS", "BASH_ENV", "X Y", "é"] {
            assert!(!shell_safe_name(bad), "{bad:?} must not be exported by a shell");
        }
        for good in ["PATH", "HOME", "GPUCI_SANDBOX_ID", "_x", "CUDA_VISIBLE_DEVICES", "lower_case"] {
            assert!(shell_safe_name(good), "{good:?}");
        }
    }

    #[test]
    fn a_ready_command_cut_short_runs_nothing_and_exports_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let marker = dir.path().join("ran");
        let env = BTreeMap::from([("SECRET".to_string(), "s3cr3t; touch x".to_string())]);
        let argv = ["/usr/bin/touch".to_string(), marker.display().to_string()];
        let line = ready_command(Path::new("/usr/bin/env"), &env, &argv);
        for cut in 1..line.len() - 1 {
            let out = run_ready_command(&line[..cut]);
            assert!(!marker.exists(), "a command cut at {cut} ran: {:?}", String::from_utf8_lossy(&line[..cut]));
            assert!(out.stdout.is_empty(), "cut at {cut} printed {:?}", String::from_utf8_lossy(&out.stdout));
        }
        run_ready_command(&line);
        assert!(marker.exists(), "the whole command should run");
    }
}
