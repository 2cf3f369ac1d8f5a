//! The `[[fleet]]` examples of the slurm guide parse and are accepted by the provider, so the
//! guide cannot drift from the settings the code reads.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

fn fleet_blocks(doc: &str) -> Vec<String> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(doc);
    let text = std::fs::read_to_string(&path).unwrap();
    let mut out = Vec::new();
    let mut block: Option<String> = None;
    for line in text.lines() {
        match (&mut block, line.trim_start()) {
            (None, l) if l.starts_with("```toml") => block = Some(String::new()),
            (Some(b), l) if l.starts_with("```") => {
                if b.contains("[[fleet]]") {
                    out.push(std::mem::take(b));
                }
                block = None;
            }
            (Some(b), _) => {
                b.push_str(line);
                b.push('\n');
            }
            _ => {}
        }
    }
    out
}

#[test]
fn the_slurm_guides_fleets_are_accepted() {
    let blocks = fleet_blocks("docs/providers/slurm.md");
    assert!(!blocks.is_empty(), "no [[fleet]] example in docs/providers/slurm.md");
    for b in blocks {
        let fleets = gpuci_core::fleet::parse_fleets("slurm.md", &b).unwrap_or_else(|e| panic!("{e}\n{b}"));
        for f in fleets.iter().filter(|f| f.provider == gpuci_core::fleet::ProviderKind::Slurm) {
            gpuci_providers::slurm::SlurmProvider::from_settings(f, "c1").unwrap_or_else(|e| panic!("{e}\n{b}"));
        }
    }
}
