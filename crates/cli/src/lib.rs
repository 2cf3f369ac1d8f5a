//! The `gpuci` command line: argument types ([`cli`]), the HTTP client ([`client`]), human
//! rendering ([`render`]), and one module per subcommand ([`cmd`]). Library so tests can call
//! subcommands without a process.

pub mod cli;
pub mod client;
pub mod cmd;
pub mod init;
pub mod logging;
pub mod render;
pub mod worktree;

/// An error with the exit code it should produce.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad input: usage or an invalid file. Exit 2.
    #[error("{0}")]
    Input(String),
    /// Anything else. Exit 1.
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Input(_) => 2,
            CliError::Other(_) => 1,
        }
    }
}

impl From<reqwest::Error> for CliError {
    fn from(e: reqwest::Error) -> Self {
        CliError::Other(e.into())
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        CliError::Other(e.into())
    }
}

pub type CliResult<T = u8> = Result<T, CliError>;
