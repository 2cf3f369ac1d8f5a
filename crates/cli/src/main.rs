//! `gpuci`: the one binary. Parses arguments, installs logging to stderr, and hands off to a
//! subcommand in `cmd/`. Exit codes: 0 success, 1 failure (a job or pipeline failed, a server
//! error), 2 bad input (usage, invalid pipeline file).

use clap::Parser;
use gpuci::cli::Cli;

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // `run` and the client commands print their own progress; server logs would drown it.
    let chatty = matches!(
        cli.command,
        gpuci::cli::Command::Up(_) | gpuci::cli::Command::Server(_) | gpuci::cli::Command::Agent(_)
    );
    gpuci::logging::init(cli.verbose, cli.quiet, chatty);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let code = runtime.block_on(gpuci::cmd::dispatch(cli));
    std::process::ExitCode::from(code)
}
