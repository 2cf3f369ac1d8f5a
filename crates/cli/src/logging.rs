//! Logs go to stderr; stdout is for data.

pub fn init(verbose: u8, quiet: bool) {
    let default = match (quiet, verbose) {
        (true, 0) => "warn",
        (true, _) => "error",
        (false, 0) => "warn,gpuci=info,gpuci_coordinator=info,gpuci_agent=info",
        (false, 1) => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPUCI_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).try_init();
}
