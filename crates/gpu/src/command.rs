//! Running external commands (`nvidia-smi`, `bwrap --version`, probes) behind a trait, so
//! the `nvidia-smi` backend and `doctor` are unit-testable with [`FakeRunner`].

use std::collections::HashMap;
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What a finished command printed and how it exited.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommandOutput {
    /// Exit code; `None` when killed by a signal.
    pub status: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl CommandOutput {
    pub fn ok(stdout: impl Into<String>) -> Self {
        CommandOutput { status: Some(0), stdout: stdout.into(), stderr: String::new() }
    }
    pub fn failed(code: i32, stdout: impl Into<String>, stderr: impl Into<String>) -> Self {
        CommandOutput { status: Some(code), stdout: stdout.into(), stderr: stderr.into() }
    }
    pub fn success(&self) -> bool {
        self.status == Some(0)
    }
    /// The last `n` non-empty lines of stdout and stderr together, for error messages.
    pub fn tail(&self, n: usize) -> String {
        let lines: Vec<&str> =
            self.stdout.lines().chain(self.stderr.lines()).filter(|l| !l.trim().is_empty()).collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    #[error("{program}: command not found")]
    NotFound { program: String },
    #[error("{program} did not finish within {}s and was killed", .after.as_secs())]
    TimedOut { program: String, after: Duration },
    #[error("{program}: {detail}")]
    Io { program: String, detail: String },
}

/// Runs a program with arguments (no shell) and waits at most `timeout`.
pub trait CommandRunner: Send + Sync {
    fn run(&self, program: &str, args: &[&str], timeout: Duration) -> Result<CommandOutput, CommandError>;
}

/// Runs real processes. The timeout matters: `nvidia-smi` can hang for minutes on a GPU
/// that fell off the bus, and a health check must not hang with it.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemRunner;

impl CommandRunner for SystemRunner {
    fn run(&self, program: &str, args: &[&str], timeout: Duration) -> Result<CommandOutput, CommandError> {
        let io = |e: std::io::Error| match e.kind() {
            std::io::ErrorKind::NotFound => CommandError::NotFound { program: program.to_string() },
            _ => CommandError::Io { program: program.to_string(), detail: e.to_string() },
        };
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(io)?;
        // Read both pipes on their own threads: a child that fills one pipe while we wait
        // on the other would otherwise deadlock.
        let drain = |pipe: Option<Box<dyn Read + Send>>| {
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                if let Some(mut p) = pipe {
                    let _ = p.read_to_end(&mut buf);
                }
                String::from_utf8_lossy(&buf).into_owned()
            })
        };
        let out = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
        let err = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
        let start = Instant::now();
        let status = loop {
            match child.try_wait().map_err(io)? {
                Some(status) => break status,
                None if start.elapsed() >= timeout => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(CommandError::TimedOut { program: program.to_string(), after: timeout });
                }
                None => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        Ok(CommandOutput {
            status: status.code(),
            stdout: out.join().unwrap_or_default(),
            stderr: err.join().unwrap_or_default(),
        })
    }
}

/// A scripted runner for tests: answers from a table keyed by the full command line
/// (`"nvidia-smi --query-gpu=name --format=csv,noheader"`), or by the program name alone
/// as a fallback; anything else is "command not found". Records every call.
#[derive(Debug, Default)]
pub struct FakeRunner {
    answers: Mutex<HashMap<String, Result<CommandOutput, CommandError>>>,
    calls: Mutex<Vec<String>>,
}

impl FakeRunner {
    pub fn new() -> Self {
        Self::default()
    }
    /// Answer `command` (a full command line or a bare program name) with `result`.
    pub fn on(&self, command: &str, result: Result<CommandOutput, CommandError>) -> &Self {
        lock(&self.answers).insert(command.to_string(), result);
        self
    }
    pub fn calls(&self) -> Vec<String> {
        lock(&self.calls).clone()
    }
}

impl CommandRunner for FakeRunner {
    fn run(&self, program: &str, args: &[&str], _timeout: Duration) -> Result<CommandOutput, CommandError> {
        let line = std::iter::once(program).chain(args.iter().copied()).collect::<Vec<_>>().join(" ");
        lock(&self.calls).push(line.clone());
        let answers = lock(&self.answers);
        answers
            .get(&line)
            .or_else(|| answers.get(program))
            .cloned()
            .unwrap_or_else(|| Err(CommandError::NotFound { program: program.to_string() }))
    }
}

/// A poisoned lock only means another test thread panicked; the data is still usable.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_runner_reports_exit_and_output() {
        let out = SystemRunner.run("sh", &["-c", "echo hi; echo oops >&2; exit 3"], Duration::from_secs(10)).unwrap();
        assert_eq!(out.status, Some(3));
        assert_eq!(out.stdout.trim(), "hi");
        assert_eq!(out.tail(5), "hi\noops");
    }

    #[test]
    fn system_runner_times_out() {
        let err = SystemRunner.run("sleep", &["5"], Duration::from_millis(100)).unwrap_err();
        assert!(matches!(err, CommandError::TimedOut { .. }), "{err}");
    }

    #[test]
    fn system_runner_not_found() {
        let err = SystemRunner.run("gpuci-no-such-program", &[], Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, CommandError::NotFound { .. }));
    }

    #[test]
    fn fake_runner_matches_full_line_then_program() {
        let r = FakeRunner::new();
        r.on("tool --version", Ok(CommandOutput::ok("1.0"))).on("tool", Ok(CommandOutput::failed(1, "", "bad")));
        assert_eq!(r.run("tool", &["--version"], Duration::ZERO).unwrap().stdout, "1.0");
        assert!(!r.run("tool", &["x"], Duration::ZERO).unwrap().success());
        assert!(r.run("other", &[], Duration::ZERO).is_err());
        assert_eq!(r.calls(), vec!["tool --version", "tool x", "other"]);
    }
}
