//! Repository archives shaped like GitHub's `tarball` downloads: a pax global header carrying the
//! commit id (what `git archive` writes), then one top-level directory `{owner}-{repo}-{sha7}/`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;

use flate2::write::GzEncoder;
use flate2::Compression;
use tar::{Builder, EntryType, Header};

pub(crate) fn build(owner: &str, repo: &str, sha: &str, files: &BTreeMap<String, String>) -> std::io::Result<Vec<u8>> {
    let top = format!("{owner}-{repo}-{}", &sha[..7.min(sha.len())]);
    let mut tar = Builder::new(GzEncoder::new(Vec::new(), Compression::fast()));

    let pax = format!("comment={sha}\n");
    // A pax record is "<length> <key>=<value>\n" where length counts the whole record, itself included.
    let mut len = pax.len() + 3;
    while format!("{len} {pax}").len() != len {
        len += 1;
    }
    let record = format!("{len} {pax}");
    let mut h = Header::new_ustar();
    h.set_path("pax_global_header")?;
    h.set_entry_type(EntryType::XGlobalHeader);
    h.set_size(record.len() as u64);
    h.set_mode(0o666);
    h.set_cksum();
    tar.append(&h, record.as_bytes())?;

    let mut dirs = BTreeSet::new();
    dirs.insert(String::new());
    for path in files.keys() {
        let mut acc = String::new();
        let parts: Vec<&str> = path.split('/').collect();
        for part in &parts[..parts.len().saturating_sub(1)] {
            acc = if acc.is_empty() { (*part).to_owned() } else { format!("{acc}/{part}") };
            dirs.insert(acc.clone());
        }
    }
    for dir in &dirs {
        let mut h = Header::new_ustar();
        let name = if dir.is_empty() { format!("{top}/") } else { format!("{top}/{dir}/") };
        h.set_path(&name)?;
        h.set_entry_type(EntryType::Directory);
        h.set_mode(0o775);
        h.set_size(0);
        h.set_cksum();
        tar.append(&h, std::io::empty())?;
    }
    for (path, content) in files {
        let mut h = Header::new_ustar();
        // Long paths need a GNU/pax extension; `append_data` writes one when the name does not fit.
        h.set_entry_type(EntryType::Regular);
        // git keeps one bit of mode: scripts stay executable.
        h.set_mode(if content.starts_with("#!") { 0o775 } else { 0o664 });
        h.set_size(content.len() as u64);
        tar.append_data(&mut h, format!("{top}/{path}"), content.as_bytes())?;
    }
    let mut gz = tar.into_inner()?;
    gz.flush()?;
    gz.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn archive_has_one_top_level_directory_and_the_files() {
        let mut files = BTreeMap::new();
        files.insert(".gpuci.yml".to_owned(), "jobs: {}\n".to_owned());
        files.insert("scripts/run.sh".to_owned(), "#!/bin/sh\necho hi\n".to_owned());
        let bytes = build("octo", "gpu", "0123456789abcdef", &files).expect("build");
        let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(&bytes[..]));
        let mut seen = Vec::new();
        for e in archive.entries().expect("entries") {
            let mut e = e.expect("entry");
            let kind = e.header().entry_type();
            let path = e.path().expect("path").display().to_string();
            let mut content = String::new();
            e.read_to_string(&mut content).expect("read");
            if kind == EntryType::XGlobalHeader {
                assert!(content.ends_with("comment=0123456789abcdef\n"), "{content:?}");
                continue;
            }
            seen.push((path, content));
        }
        let paths: Vec<&str> = seen.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "octo-gpu-0123456/",
                "octo-gpu-0123456/scripts/",
                "octo-gpu-0123456/.gpuci.yml",
                "octo-gpu-0123456/scripts/run.sh"
            ]
        );
        assert_eq!(seen[2].1, "jobs: {}\n");
    }
}
