//! Budget holds in the placement pass: whether a queued job is held off fleet machines
//! because its repository is past its daily budget. Pure: the budgets reached come from the
//! fleets' loop ([`crate::fleet::budget::all_reached`]), the job's repository from the
//! caller's read of its pipeline; the scheduler applies the answer.
//!
//! The rules, here and nowhere else:
//! - No budget reached: nothing is held, and the job's repository need not be read.
//! - A job whose repository a reached budget covers runs on no fleet machine until 00:00 UTC
//!   (machines that no fleet made still take it).
//! - A job with no repository (submitted through the API) is not held: no budget covers it.
//! - A job whose repository could not be read (the store did not answer) is held: a budget
//!   must not lift for want of a read.
//!
//! What must not live here: I/O (the store read is the caller's), clocks.

use crate::fleet::RepoBudget;

/// What the caller knows of a job's repository.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Repository<'a> {
    /// Its printed identity (`github.com/acme/x`: how budgets' spend is keyed).
    Named(&'a str),
    /// It has none (a pipeline submitted through the API).
    Absent,
    /// It could not be read now.
    Unread,
}

/// Whether the job's repository is needed to decide: only while some budget is reached.
pub fn needs_repository(reached: &[RepoBudget]) -> bool {
    !reached.is_empty()
}

/// Whether a job of `repository` is held off fleet machines, given the budgets `reached`
/// today.
pub fn held(reached: &[RepoBudget], repository: Repository<'_>) -> bool {
    if !needs_repository(reached) {
        return false;
    }
    match repository {
        Repository::Named(r) => reached.iter().any(|b| b.covers(r)),
        Repository::Absent => false,
        Repository::Unread => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::budget::parse_budgets;

    fn reached() -> Vec<RepoBudget> {
        let text =
            "[[budget]]\nrepository = \"acme/x\"\ndaily = 10.0\n\n[[budget]]\nrepository = \"other/*\"\ndaily = 5.0\n";
        parse_budgets("budgets.toml", text, "github.com").expect("budgets parse")
    }

    #[test]
    fn a_job_of_a_repository_past_its_budget_is_held_and_others_are_not() {
        let r = reached();
        assert!(held(&r, Repository::Named("github.com/acme/x")));
        assert!(held(&r, Repository::Named("github.com/other/y")), "an owner's budget covers its repositories");
        assert!(!held(&r, Repository::Named("github.com/acme/y")));
        assert!(!held(&r, Repository::Absent), "no repository, no budget");
    }

    #[test]
    fn a_repository_that_could_not_be_read_is_held_while_a_budget_is_reached() {
        assert!(held(&reached(), Repository::Unread), "a budget must not lift for want of a read");
        assert!(!held(&[], Repository::Unread), "no budget reached: nothing to hold");
    }

    #[test]
    fn nothing_is_held_and_nothing_read_while_no_budget_is_reached() {
        assert!(!needs_repository(&[]));
        assert!(needs_repository(&reached()));
        assert!(!held(&[], Repository::Named("github.com/acme/x")));
    }
}
