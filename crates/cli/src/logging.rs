//! Logs go to stderr; stdout is for data.

/// `chatty`: long-running services log their work at info by default; client commands and
/// `gpuci run` show only warnings so their own progress output stays readable.
pub fn init(verbose: u8, quiet: bool, chatty: bool) {
    let default = match (quiet, verbose, chatty) {
        (true, _, _) => "error",
        (false, 0, false) => "warn",
        (false, 0, true) => "warn,gpuci=info,gpuci_coordinator=info,gpuci_agent=info",
        (false, 1, _) => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPUCI_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colour codes only for a terminal: in a file or a CI log they are noise (and a reader of
    // such a log must not have to trust escape sequences in it).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    // A log that cannot be written (stderr on a full disk, a closed pipe) loses those lines;
    // it must not take the process with it: the subscriber's own error report is `eprint!`,
    // which panics when stderr fails, and an agent died mid-line with its jobs (outsider
    // attack).
    let _ = tracing_subscriber::fmt()
        .log_internal_errors(false)
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_target(false)
        .try_init();
}
