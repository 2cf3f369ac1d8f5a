//! `gpuci submit FILE [--wait]`.

use super::read_pipeline;
use crate::cli::SubmitArgs;
use crate::client::Client;
use crate::render::jobs_table;
use crate::CliResult;

pub async fn run(a: SubmitArgs) -> CliResult {
    let (source, _) = read_pipeline(&a.file)?;
    let c = Client::from_args(&a.client)?;
    let p = c.submit_file(&a.file, source, &a.upload).await?;
    if !a.wait {
        if a.client.json {
            println!("{}", serde_json::to_string_pretty(&p).map_err(anyhow::Error::from)?);
        } else {
            println!("{}", p.id);
            eprint!("{}", jobs_table(&p.jobs));
        }
        return Ok(0);
    }
    eprintln!("pipeline {} submitted ({} jobs)", p.id, p.jobs.len());
    super::follow(&c, &p, a.client.json).await
}
