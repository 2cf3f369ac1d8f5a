//! `gpuci`: the one binary. Parses arguments, installs logging to stderr, and hands off to a
//! subcommand in `cmd/`. Exit codes: 0 success, 1 failure (a job or pipeline failed, a server
//! error), 2 bad input (usage, invalid pipeline file).

use clap::Parser;
use gpuci::cli::Cli;

fn main() -> std::process::ExitCode {
    // The agent's reaper (`gpuci_agent::reaper`), started by the agent itself: no runtime, no
    // logging set-up, nothing but its wait and its sweep.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(gpuci_agent::reaper::SUBCOMMAND) {
        return std::process::ExitCode::from(gpuci_agent::reaper::main(&args[1..]));
    }
    let cli = Cli::parse();
    if matches!(cli.command, gpuci::cli::Command::Agent(_)) && std::process::id() == 1 {
        if let Some(code) = gpuci::init::init_for_the_agent() {
            return code;
        }
    }
    if !runs_jobs_or_serves(&cli.command) {
        die_quietly_on_closed_stdout();
    } else {
        // Whatever started us may have left descriptors open (a root-only file, a pipe): none
        // may reach a job. Refuse to run jobs at all if that cannot be ensured.
        if let Err(e) = gpuci_sandbox::seal_inherited_fds() {
            eprintln!("error: cannot mark inherited file descriptors close-on-exec: {e}");
            return std::process::ExitCode::from(1);
        }
        if nix::unistd::geteuid().is_root() {
            private_mounts();
        }
    }
    // `run` and the client commands print their own progress; server logs would drown it.
    let chatty = matches!(
        cli.command,
        gpuci::cli::Command::Up(_) | gpuci::cli::Command::Server(_) | gpuci::cli::Command::Agent(_)
    );
    gpuci::logging::init(cli.verbose, cli.quiet, chatty);
    // A client command waits on one server at a time: one thread, without the worker threads
    // (and the cgroup CPU-quota reads that size them) a multi-threaded runtime starts with.
    let runtime = if runs_jobs_or_serves(&cli.command) {
        tokio::runtime::Builder::new_multi_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    };
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let code = runtime.block_on(gpuci::cmd::dispatch(cli));
    std::process::ExitCode::from(code)
}

/// Commands that run a server, an agent or jobs in this process. They keep Rust's default of
/// ignoring SIGPIPE: a job or peer that closes its end of a pipe must cost an error on that
/// write, never the whole process.
fn runs_jobs_or_serves(command: &gpuci::cli::Command) -> bool {
    use gpuci::cli::Command as C;
    matches!(command, C::Up(_) | C::Run(_) | C::Server(_) | C::Agent(_) | C::Bench(_))
}

/// A root agent mounts a disk per job slot (`gpuci_sandbox::SlotDisk`). In a mount namespace
/// of its own, those mounts die with the process however it ends (SIGKILL included), instead
/// of being left on the host. Mounts made on the host later still reach it (`MS_SLAVE`).
/// Before any thread exists: a multi-threaded process cannot leave its mount namespace.
fn private_mounts() {
    use nix::mount::{mount, MsFlags};
    let done = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
        .and_then(|()| mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_SLAVE, None::<&str>));
    if let Err(e) = done {
        eprintln!("warning: no private mount namespace ({e}): slot disks of a killed agent stay mounted");
    }
}

/// A client command whose reader goes away (`gpuci logs 7 | head`) ends as Unix tools do, by
/// SIGPIPE, silently, instead of panicking in `println!` with "failed printing to stdout".
#[allow(unsafe_code)]
fn die_quietly_on_closed_stdout() {
    use nix::sys::signal::{signal, SigHandler, Signal};
    // SAFETY: called first thing in `main`, before the runtime or any other thread exists;
    // the default disposition runs no code of ours.
    if let Err(e) = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) } {
        eprintln!("warning: cannot restore SIGPIPE: {e}");
    }
}
