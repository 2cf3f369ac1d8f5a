//! TEMPORARY: being replaced by the real parser (spanned YAML → Pipeline).
use super::Pipeline;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}:{column}: {field}: {message}")]
pub struct PipelineError {
    pub file: String,
    pub line: usize,
    pub column: usize,
    pub field: String,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n"))]
pub struct PipelineErrors(pub Vec<PipelineError>);

pub fn parse(file: &str, _text: &str) -> Result<Pipeline, PipelineErrors> {
    Err(PipelineErrors(vec![PipelineError { file: file.into(), line: 1, column: 1, field: String::new(), message: "parser not built yet".into() }]))
}
