//! Repository budgets: `[[budget]]` entries of the server config, and which of them today's
//! spend has reached. A reached budget keeps that repository's jobs off fleet
//! machines until 00:00 UTC: none is created or started for them, and they take no free GPU on
//! one that exists ([`super::decide`] holds them; they may still run on agents no fleet made,
//! which gpuci bills nothing for).
//!
//! ```toml
//! [[budget]]
//! repository = "acme/kernels"   # one repository
//! daily = 20.0                  # USD per UTC day, its jobs' shares on every fleet
//! [[budget]]
//! repository = "acme/*"         # every repository of acme, together
//! daily = 100.0
//! [[budget]]
//! repository = "gitlab.com/acme/*"  # another host: named with it
//! daily = 10.0
//! ```
//!
//! A bare `owner/name` or `owner/*` is on the configured GitHub host (`github.com` unless
//! GitHub Enterprise is configured); any other host is written out. `acme/*` does not cover
//! `gitlab.com/acme/x`: repositories are told apart by host ([`crate::repo`]).
//!
//! Spend is what the cost report attributes to the repository: its jobs' shares of their
//! machines (GPUs leased × price, per second). Boot and idle time are the fleet's overhead,
//! capped by the fleet's own `daily_budget`.
//!
//! **Expected cost before a machine is made.** Spend so far is not enough: a budget checked
//! against it alone lets the last dollars start machines (and jobs) that will pass it
//! mid-job. So before a machine is made, what it will cost is counted ([`Expected`]): for a
//! fleet's `daily_budget`, the machine's boot (or start) and the expected run of the longest
//! job it is made for, at its price ([`machine_usd`]); for a repository's budget, the job's
//! share of that run ([`job_usd`]). Machines (and jobs) are admitted in queue order while
//! spend + what was admitted before in the same pass + their own cost stays within the budget
//! ([`admit`]); the rest wait, and say so ([`Expected::reason`]). A job's expected run is its
//! step's median of recent runs when known (`super::fanout::StepDurations`), else the fleet's
//! mean work per job (`super::profile`), else nothing is expected of it (only spend counts,
//! as before). Running machines are not stopped for a budget: a job that started runs to its
//! end.

use super::config::{line_col, FleetConfigError};
use crate::repo::RepoPattern;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One `[[budget]]`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RepoBudget {
    /// One repository, or every repository of an owner (or group) on a host together.
    pub repository: RepoPattern,
    /// USD per UTC day.
    pub daily: f64,
}

impl RepoBudget {
    /// Whether `repository` (a printed identity, `github.com/acme/x`: how spend is keyed)
    /// counts toward this budget.
    pub fn covers(&self, repository: &str) -> bool {
        self.repository.covers_printed(repository)
    }

    /// What the repositories it covers spent, given spend per repository.
    pub fn spent(&self, spend: &BTreeMap<String, f64>) -> f64 {
        spend.iter().filter(|(r, _)| self.covers(r)).map(|(_, usd)| usd).sum()
    }
}

/// A budget that today's spend has reached, for the job that waits on it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BudgetReached {
    pub repository: String,
    pub daily: f64,
    pub spent: f64,
}

impl BudgetReached {
    pub fn reason(&self) -> String {
        format!(
            "repository {}: daily budget ${:.2} reached (${:.2} spent); no machine is made for its jobs until 00:00 UTC",
            self.repository, self.daily, self.spent
        )
    }
}

/// The first budget covering `repository` that `spend` (USD today per repository) has
/// reached.
pub fn reached(budgets: &[RepoBudget], spend: &BTreeMap<String, f64>, repository: &str) -> Option<BudgetReached> {
    budgets.iter().find_map(|b| {
        let spent = b.spent(spend);
        (b.covers(repository) && spent >= b.daily).then(|| BudgetReached {
            repository: b.repository.to_string(),
            daily: b.daily,
            spent,
        })
    })
}

/// Every budget that `spend` (USD today per repository) has reached: the scheduler keeps
/// the jobs of the repositories they cover off fleet machines.
pub fn all_reached(budgets: &[RepoBudget], spend: &BTreeMap<String, f64>) -> Vec<RepoBudget> {
    budgets.iter().filter(|b| b.spent(spend) >= b.daily).cloned().collect()
}

/// What a machine made for jobs is expected to cost, USD: billed from its create (or start)
/// through its boot and the longest expected run of its jobs.
pub fn machine_usd(price_per_hour: f64, boot_s: u64, run_s: u64) -> f64 {
    price_per_hour * (boot_s + run_s) as f64 / 3600.0
}

/// A job's expected share of its machine, USD: its GPUs over the machine's, for its run.
pub fn job_usd(price_per_hour: f64, job_gpus: u32, machine_gpus: u32, run_s: u64) -> f64 {
    super::job_cost(run_s as i64 * 1000, job_gpus, machine_gpus, price_per_hour)
}

/// How many of `costs` (in order) fit within `budget` after `spent`: the longest prefix whose
/// running sum keeps `spent + sum ≤ budget`. An item that does not fit stops the count (a later,
/// cheaper one does not jump the queue).
pub fn admit(budget: f64, spent: f64, costs: &[f64]) -> usize {
    let mut sum = spent;
    for (k, c) in costs.iter().enumerate() {
        if sum + c > budget + 1e-9 {
            return k;
        }
        sum += c;
    }
    costs.len()
}

/// A budget that the expected cost of what would be made next would pass.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Expected {
    /// `fleet t4` or `repository github.com/acme/x`.
    pub whose: String,
    pub daily: f64,
    pub spent: f64,
    /// Expected for what this pass admitted before (machines or jobs), and how many.
    pub admitted: f64,
    pub admitted_n: usize,
    /// Expected for the one that does not fit.
    pub next: f64,
}

impl Expected {
    pub fn reason(&self) -> String {
        let before = if self.admitted_n > 0 {
            format!(" + ${:.2} expected for {} already given machines", self.admitted, self.admitted_n)
        } else {
            String::new()
        };
        format!(
            "{}: daily budget ${:.2}: ${:.2} spent{before} + ${:.2} expected for this one (boot and expected run) \
             would pass it; no machine is made for it, so none is stopped mid-job",
            self.whose, self.daily, self.spent, self.next
        )
    }
}

/// The first budget covering `repository` that `spend` plus what this pass admitted for the
/// repositories it covers (`pending`, USD by repository) plus `cost` would pass.
pub fn would_pass(
    budgets: &[RepoBudget],
    spend: &BTreeMap<String, f64>,
    pending: &BTreeMap<String, (f64, usize)>,
    repository: &str,
    cost: f64,
) -> Option<Expected> {
    budgets.iter().filter(|b| b.covers(repository)).find_map(|b| {
        let spent = b.spent(spend);
        let (admitted, admitted_n) =
            pending.iter().filter(|(r, _)| b.covers(r)).fold((0.0, 0), |(usd, n), (_, (u, k))| (usd + u, n + k));
        (spent + admitted + cost > b.daily + 1e-9).then(|| Expected {
            whose: format!("repository {}", b.repository),
            daily: b.daily,
            spent,
            admitted,
            admitted_n,
            next: cost,
        })
    })
}

#[derive(Deserialize)]
struct Document {
    #[serde(default)]
    budget: Vec<toml::Spanned<BudgetFile>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BudgetFile {
    repository: toml::Spanned<String>,
    daily: toml::Spanned<f64>,
}

/// Every `[[budget]]` of a server config's text; `file_name` names it in errors, which say
/// `file:line:column: budget[i]: field: what`; bare names are on `github_host`. Other
/// sections are ignored here.
pub fn parse_budgets(file_name: &str, text: &str, github_host: &str) -> Result<Vec<RepoBudget>, FleetConfigError> {
    let err = |offset: Option<usize>, what: String| FleetConfigError {
        file: file_name.to_string(),
        at: offset.map(|o| line_col(text, o)),
        what,
    };
    let doc: Document = serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|e| {
        let offset = e.inner().span().map(|s| s.start);
        let message = e.inner().message().trim_end().to_string();
        err(offset, describe(e.path(), &message))
    })?;
    let mut out: Vec<RepoBudget> = Vec::with_capacity(doc.budget.len());
    for (i, b) in doc.budget.into_iter().enumerate() {
        let b = b.into_inner();
        let (repo_at, repo) = (b.repository.span().start, b.repository.into_inner());
        let (daily_at, daily) = (b.daily.span().start, b.daily.into_inner());
        let fail = |at: usize, field: &str, what: String| err(Some(at), format!("budget[{i}]: {field}: {what}"));
        let Ok(pattern) = RepoPattern::parse(&repo, github_host) else {
            return Err(fail(
                repo_at,
                "repository",
                format!("expected owner/name or owner/* (on GitHub), or host/path or host/group/*, got {repo:?}"),
            ));
        };
        if !(daily.is_finite() && daily > 0.0) {
            return Err(fail(daily_at, "daily", format!("expected USD > 0, got {daily}")));
        }
        if out.iter().any(|o| o.repository == pattern) {
            return Err(fail(repo_at, "repository", format!("{repo} has a budget already")));
        }
        out.push(RepoBudget { repository: pattern, daily });
    }
    Ok(out)
}

/// `budget[0]: daily: what`, from the deserializer's path (without `toml::Spanned`'s own
/// wrapper keys, and without the unknown key an "unknown field" message names already).
pub(crate) fn describe(path: &serde_path_to_error::Path, message: &str) -> String {
    use serde_path_to_error::Segment;
    let mut parts: Vec<String> = Vec::new();
    for s in path.iter() {
        match s {
            Segment::Seq { index } => match parts.last_mut() {
                Some(last) => last.push_str(&format!("[{index}]")),
                None => parts.push(format!("[{index}]")),
            },
            Segment::Map { key } if !key.starts_with("$__") => parts.push(key.clone()),
            _ => {}
        }
    }
    if message.starts_with("unknown field") && parts.len() > 1 {
        parts.pop();
    }
    parts.push(message.to_string());
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<RepoBudget>, String> {
        parse_budgets("server.toml", text, "github.com").map_err(|e| e.to_string())
    }

    #[test]
    fn budgets_parse_and_bad_ones_say_where() {
        let text = "[github]\nx = 1\n[[budget]]\nrepository = \"acme/kernels\"\ndaily = 20.0\n[[budget]]\nrepository = \"acme/*\"\ndaily = 100\n";
        assert_eq!(
            parse(text).unwrap(),
            [
                RepoBudget { repository: RepoPattern::parse("github.com/acme/kernels", "").unwrap(), daily: 20.0 },
                RepoBudget { repository: RepoPattern::parse("github.com/acme/*", "").unwrap(), daily: 100.0 }
            ]
        );
        assert_eq!(parse("").unwrap(), []);
        let e = parse("[[budget]]\nrepository = \"acme\"\ndaily = 1.0\n").unwrap_err();
        assert_eq!(
            e,
            "server.toml:2:14: budget[0]: repository: expected owner/name or owner/* (on GitHub), or host/path or host/group/*, got \"acme\""
        );
        let e = parse("[[budget]]\nrepository = \"a/b\"\ndaily = -1.0\n").unwrap_err();
        assert_eq!(e, "server.toml:3:9: budget[0]: daily: expected USD > 0, got -1");
        let e = parse("[[budget]]\nrepository = \"a/b\"\ndaily = 1.0\nmonthly = 3\n").unwrap_err();
        assert!(e.starts_with("server.toml:4:1: budget[0]: unknown field `monthly`"), "{e}");
        let e = parse("[[budget]]\nrepository = \"a/b\"\n").unwrap_err();
        assert!(e.contains("budget[0]: missing field `daily`"), "{e}");
        let e = parse("[[budget]]\nrepository = \"a/b\"\ndaily = \"lots\"\n").unwrap_err();
        assert!(e.starts_with("server.toml:3:9: budget[0]: daily:"), "{e}");
        let e = parse("[[budget]]\nrepository = \"A/B\"\ndaily = 1.0\n[[budget]]\nrepository = \"a/b\"\ndaily = 2.0\n")
            .unwrap_err();
        assert_eq!(e, "server.toml:5:14: budget[1]: repository: a/b has a budget already");
        for bad in ["a/..", "/b", "a/", "a/b/c", "a b/c", "*/*"] {
            assert!(parse(&format!("[[budget]]\nrepository = \"{bad}\"\ndaily = 1.0\n")).is_err(), "{bad}");
        }
    }

    #[test]
    fn machines_are_admitted_in_order_while_spend_and_expected_cost_fit() {
        // $10 budget, $7 spent: a $2 machine fits, the next $2 would make $11.
        assert_eq!(admit(10.0, 7.0, &[2.0, 2.0, 0.5]), 1, "a cheaper later one does not jump the queue");
        assert_eq!(admit(10.0, 7.0, &[1.5, 1.5]), 2, "exactly the budget fits");
        assert_eq!(admit(10.0, 10.0, &[0.0]), 1, "nothing expected: spend alone decides, as before");
        assert_eq!(admit(10.0, 10.5, &[0.1]), 0);
        // A T4 ($0.526/h) booting 2 minutes for a 58-minute job: one hour, $0.526.
        assert!((machine_usd(0.526, 120, 3480) - 0.526).abs() < 1e-12);
        assert!((job_usd(8.0, 2, 8, 1800) - 1.0).abs() < 1e-12, "2 of 8 GPUs for half an hour of $8/h");
    }

    #[test]
    fn a_repository_budget_counts_what_the_pass_already_admitted() {
        let budgets = parse("[[budget]]\nrepository = \"acme/*\"\ndaily = 10.0\n").unwrap();
        let spend: BTreeMap<String, f64> = [("github.com/acme/a".to_string(), 6.0)].into_iter().collect();
        let mut pending = BTreeMap::new();
        assert!(would_pass(&budgets, &spend, &pending, "github.com/acme/b", 3.0).is_none());
        pending.insert("github.com/acme/a".to_string(), (3.0, 1));
        let e = would_pass(&budgets, &spend, &pending, "github.com/acme/b", 3.0).expect("6 + 3 + 3 > 10");
        assert_eq!((e.spent, e.admitted, e.admitted_n, e.next), (6.0, 3.0, 1, 3.0));
        assert_eq!(
            e.reason(),
            "repository github.com/acme/*: daily budget $10.00: $6.00 spent + $3.00 expected for 1 already given \
             machines + $3.00 expected for this one (boot and expected run) would pass it; no machine is made for it, \
             so none is stopped mid-job"
        );
        assert!(would_pass(&budgets, &spend, &pending, "github.com/other/x", 100.0).is_none(), "no budget, no limit");
    }

    #[test]
    fn an_owner_budget_counts_all_its_repositories_together() {
        let budgets = parse("[[budget]]\nrepository = \"acme/kernels\"\ndaily = 20.0\n[[budget]]\nrepository = \"Acme/*\"\ndaily = 30.0\n").unwrap();
        let spend: BTreeMap<String, f64> = [
            ("github.com/acme/kernels".to_string(), 12.0),
            ("github.com/acme/docs".to_string(), 19.0),
            ("github.com/other/x".to_string(), 99.0),
            // The same owner on another host is another owner: its spend is not acme's.
            ("gitlab.com/acme/kernels".to_string(), 500.0),
        ]
        .into_iter()
        .collect();
        // acme/kernels is under its own 20 but acme's 30 is reached (31 spent).
        let r = reached(&budgets, &spend, "github.com/acme/kernels").unwrap();
        assert_eq!((r.repository.as_str(), r.daily, r.spent), ("github.com/acme/*", 30.0, 31.0));
        assert!(
            r.reason().contains("repository github.com/acme/*: daily budget $30.00 reached ($31.00 spent)"),
            "{}",
            r.reason()
        );
        assert!(reached(&budgets, &spend, "github.com/other/x").is_none(), "no budget, no limit");
        assert!(reached(&budgets, &spend, "gitlab.com/acme/kernels").is_none(), "another host: no budget of acme's");
        let lower: BTreeMap<String, f64> = [("github.com/acme/kernels".to_string(), 20.0)].into_iter().collect();
        assert_eq!(reached(&budgets, &lower, "github.com/acme/kernels").unwrap().repository, "github.com/acme/kernels");
        assert!(reached(&budgets, &lower, "github.com/acme/docs").is_none());
        assert!(reached(&budgets, &lower, "acme/kernels").is_none(), "spend is keyed by identities with a host");
    }
}
