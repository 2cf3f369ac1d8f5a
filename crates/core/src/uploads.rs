//! Which workspace uploads may be deleted: the rules of upload garbage collection, here and
//! nowhere else. The coordinator's collector gathers plain facts (each stored upload's size and
//! last write, the pipelines that name it and whether any of their jobs may still run), calls
//! [`decide`], and only deletes what the [`Plan`] names. A store other than the local directory
//! (issue 29: shared uploads) gathers the same facts and applies the same plan.
//!
//! The rules:
//! 1. An upload named by a pipeline with a job that may still run (queued, assigned or running;
//!    an automatic retry or a requeue is a queued job, written in the same commit that ends the
//!    attempt before it) is **never** deleted, whatever its age and the size cap.
//! 2. Any other upload goes once it has been unused for `retention`. It was last used at the
//!    latest of: its file's last write (an upload of the same bytes again touches it) and the
//!    last activity of every pipeline naming it (created, a job created or finished). So a
//!    pipeline that waited in the queue for longer than `retention` still keeps its upload for
//!    `retention` after it finishes: time for a retry by hand.
//! 3. With `max_total`, while the uploads that stay still add up to more than it, the
//!    least recently used deletable upload goes next (ties: the smaller id first, so the
//!    order is total). Uploads used less than `min(retention, FRESH)` ago are not deletable
//!    by the cap: a client uploads first and names the upload in a pipeline a moment later.
//!    When what is left is pinned or fresh, the plan says by how much it stays over.
//! 4. A temporary file (an upload being written, or one a crash interrupted) goes once it has
//!    not been written for [`STALE_TEMP_MS`]; a live upload writes to it continuously.
//! 5. An upload no pipeline names yet, last written less than `unnamed_grace_ms` ago (an hour:
//!    the coordinator's `SHARED_GRACE`), is kept whatever the retention and the cap: it was
//!    just stored, and its pipeline — a client's next request, or another coordinator's
//!    commit on a shared bucket, which no gate of this process holds back — is on its way.
//!    Its last write is the file's mtime, or the object's `LastModified` in S3.
//!
//! Deciding here does not make deleting safe against a new use arriving between the facts and
//! the delete: the collector holds its gate over gathering, deciding and deleting, and every new
//! use (storing, touching, committing a pipeline that names an upload) holds the other side.

use std::collections::BTreeMap;

/// How long an upload stays deletable only by age, not by the size cap, after a use:
/// `gpuci submit` uploads and then names the upload in a pipeline within seconds.
pub const FRESH_MS: i64 = 15 * 60 * 1000;

/// A temporary file not written for this long belongs to no live upload.
pub const STALE_TEMP_MS: i64 = 60 * 60 * 1000;

/// One upload as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredUpload {
    /// Its id: the sha256 of its bytes.
    pub id: String,
    pub bytes: u64,
    /// When its file was last written or touched (Unix ms).
    pub modified_ms: i64,
}

/// A pipeline that names an upload, as the store sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineUse {
    pub upload: String,
    pub pipeline_id: i64,
    /// Jobs of the pipeline that may still run: queued, assigned or running.
    pub unfinished_jobs: u64,
    /// The pipeline's last activity (Unix ms): its creation, or a job's creation or end.
    pub last_active_ms: i64,
}

/// A temporary file in the uploads directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TempFile {
    pub name: String,
    pub bytes: u64,
    pub modified_ms: i64,
}

/// What the operator configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Unused (and unneeded) this long, an upload goes.
    pub retention_ms: i64,
    /// The most all uploads together may hold, if capped.
    pub max_total: Option<u64>,
    /// An upload no pipeline names, written less than this ago, stays (rule 5).
    pub unnamed_grace_ms: i64,
}

/// Why an upload goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Why {
    /// Unused for longer than the retention.
    Retention,
    /// The oldest unneeded upload while the total is over the size cap.
    MaxTotal,
}

impl Why {
    /// The metrics label and log word.
    pub fn as_str(self) -> &'static str {
        match self {
            Why::Retention => "retention",
            Why::MaxTotal => "max_total",
        }
    }
}

/// One upload to delete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deletion {
    pub id: String,
    pub bytes: u64,
    pub why: Why,
}

/// What [`decide`] says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Uploads to delete, in the order the rules chose them.
    pub delete: Vec<Deletion>,
    /// Temporary files to delete (names).
    pub delete_temp: Vec<String>,
    /// Uploads that stay, and their bytes.
    pub kept: u64,
    pub kept_bytes: u64,
    /// Uploads kept because a pipeline naming them may still run.
    pub pinned: u64,
    /// With a size cap: how far the uploads that stay are over it (pinned or fresh ones).
    pub over_cap_bytes: u64,
}

/// Decide which uploads and temporary files go at `now_ms` (module docs: the rules).
/// `uses` may name uploads that are not stored (deleted before); they are ignored.
pub fn decide(now_ms: i64, policy: Policy, uploads: &[StoredUpload], uses: &[PipelineUse], temps: &[TempFile]) -> Plan {
    // Per upload: pinned, its last use, and whether any pipeline names it.
    let mut facts: BTreeMap<&str, (bool, i64, bool)> = BTreeMap::new();
    for u in uploads {
        facts.insert(u.id.as_str(), (false, u.modified_ms, false));
    }
    for p in uses {
        if let Some((pinned, last, named)) = facts.get_mut(p.upload.as_str()) {
            *pinned |= p.unfinished_jobs > 0;
            *last = (*last).max(p.last_active_ms);
            *named = true;
        }
    }
    let retention = policy.retention_ms.max(0);
    let fresh = retention.min(FRESH_MS);
    let mut plan = Plan::default();
    // (last use, id, bytes) of uploads the cap may take, oldest first.
    let mut cap_candidates: Vec<(i64, &str, u64)> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for u in uploads {
        // The same id listed twice is one upload.
        if !seen.insert(u.id.as_str()) {
            continue;
        }
        let (pinned, last, named) = facts[u.id.as_str()];
        let idle = now_ms.saturating_sub(last);
        let in_grace = !named && now_ms.saturating_sub(u.modified_ms) < policy.unnamed_grace_ms;
        if pinned {
            plan.pinned += 1;
        } else if in_grace {
            // Rule 5: neither the retention nor the cap takes it yet.
        } else if idle > retention {
            plan.delete.push(Deletion { id: u.id.clone(), bytes: u.bytes, why: Why::Retention });
            continue;
        } else if idle >= fresh {
            cap_candidates.push((last, u.id.as_str(), u.bytes));
        }
        plan.kept += 1;
        plan.kept_bytes += u.bytes;
    }
    if let Some(cap) = policy.max_total {
        cap_candidates.sort();
        for (_, id, bytes) in cap_candidates {
            if plan.kept_bytes <= cap {
                break;
            }
            plan.delete.push(Deletion { id: id.to_string(), bytes, why: Why::MaxTotal });
            plan.kept -= 1;
            plan.kept_bytes -= bytes;
        }
        plan.over_cap_bytes = plan.kept_bytes.saturating_sub(cap);
    }
    plan.delete_temp =
        temps.iter().filter(|t| now_ms.saturating_sub(t.modified_ms) > STALE_TEMP_MS).map(|t| t.name.clone()).collect();
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const H: i64 = 3_600_000;
    const D: i64 = 24 * H;
    const NOW: i64 = 100 * D;

    fn id(c: char) -> String {
        c.to_string().repeat(64)
    }

    fn up(c: char, bytes: u64, modified_ms: i64) -> StoredUpload {
        StoredUpload { id: id(c), bytes, modified_ms }
    }

    fn used(c: char, pipeline_id: i64, unfinished_jobs: u64, last_active_ms: i64) -> PipelineUse {
        PipelineUse { upload: id(c), pipeline_id, unfinished_jobs, last_active_ms }
    }

    fn week() -> Policy {
        Policy { retention_ms: 7 * D, max_total: None, unnamed_grace_ms: 0 }
    }

    fn deleted(plan: &Plan) -> Vec<(char, Why)> {
        plan.delete.iter().map(|d| (d.id.chars().next().unwrap(), d.why)).collect()
    }

    /// The retention rule, one case a row: (what, upload's last write, its pipelines, goes?).
    #[test]
    fn retention_table() {
        type Uses = Vec<(i64, u64, i64)>;
        let cases: Vec<(&str, i64, Uses, bool)> = vec![
            ("unnamed, written 8 days ago", NOW - 8 * D, vec![], true),
            ("unnamed, written 6 days ago", NOW - 6 * D, vec![], false),
            ("unnamed, exactly the retention ago", NOW - 7 * D, vec![], false),
            ("finished pipeline, idle 8 days", NOW - 30 * D, vec![(1, 0, NOW - 8 * D)], true),
            ("finished pipeline, finished 1 day ago after a long queue", NOW - 30 * D, vec![(1, 0, NOW - D)], false),
            ("queued pipeline, 30 days old", NOW - 30 * D, vec![(1, 1, NOW - 30 * D)], false),
            (
                "one finished, one with a job that may run",
                NOW - 30 * D,
                vec![(1, 0, NOW - 30 * D), (2, 3, NOW - 20 * D)],
                false,
            ),
            ("two finished pipelines, both idle", NOW - 30 * D, vec![(1, 0, NOW - 9 * D), (2, 0, NOW - 8 * D)], true),
            ("two finished pipelines, one recent", NOW - 30 * D, vec![(1, 0, NOW - 9 * D), (2, 0, NOW - H)], false),
            ("uploaded again an hour ago", NOW - H, vec![(1, 0, NOW - 30 * D)], false),
            ("a clock that went back: written in the future", NOW + D, vec![], false),
        ];
        for (what, modified, uses, goes) in cases {
            let uploads = [up('a', 10, modified)];
            let uses: Vec<_> = uses.into_iter().map(|(p, n, at)| used('a', p, n, at)).collect();
            let plan = decide(NOW, week(), &uploads, &uses, &[]);
            assert_eq!(!plan.delete.is_empty(), goes, "{what}: {plan:?}");
            assert_eq!(plan.kept, u64::from(!goes), "{what}");
        }
    }

    #[test]
    fn the_cap_takes_the_least_recently_used_unneeded_uploads_first() {
        let uploads = [
            up('a', 40, NOW - 5 * D),  // oldest use, unneeded: first to go
            up('b', 40, NOW - 4 * D),  // needed by a queued pipeline: stays
            up('c', 40, NOW - 3 * D),  // next oldest: goes second
            up('d', 40, NOW - 2 * D),  // once under the cap, nothing more goes
            up('e', 40, NOW - 60_000), // fresh: the cap never takes it
        ];
        let uses = [used('b', 1, 2, NOW - 4 * D), used('c', 2, 0, NOW - 3 * D)];
        let policy = Policy { retention_ms: 7 * D, max_total: Some(100), unnamed_grace_ms: 0 };
        let plan = decide(NOW, policy, &uploads, &uses, &[]);
        assert_eq!(deleted(&plan), [('a', Why::MaxTotal), ('c', Why::MaxTotal), ('d', Why::MaxTotal)]);
        assert_eq!((plan.kept, plan.kept_bytes, plan.pinned, plan.over_cap_bytes), (2, 80, 1, 0));
    }

    #[test]
    fn pinned_and_fresh_uploads_may_leave_the_total_over_the_cap() {
        let uploads = [up('a', 500, NOW - 30 * D), up('b', 300, NOW - 1000), up('c', 10, NOW - 9 * D)];
        let uses = [used('a', 1, 1, NOW - 30 * D)];
        let policy = Policy { retention_ms: 7 * D, max_total: Some(100), unnamed_grace_ms: 0 };
        let plan = decide(NOW, policy, &uploads, &uses, &[]);
        assert_eq!(deleted(&plan), [('c', Why::Retention)]);
        assert_eq!((plan.kept_bytes, plan.over_cap_bytes), (800, 700));
    }

    #[test]
    fn ties_in_age_go_by_id_and_retention_comes_before_the_cap() {
        let uploads = [up('b', 10, NOW - D), up('a', 10, NOW - D), up('z', 10, NOW - 8 * D)];
        let policy = Policy { retention_ms: 7 * D, max_total: Some(10), unnamed_grace_ms: 0 };
        let plan = decide(NOW, policy, &uploads, &[], &[]);
        assert_eq!(deleted(&plan), [('z', Why::Retention), ('a', Why::MaxTotal)]);
    }

    #[test]
    fn a_short_retention_shortens_the_fresh_window() {
        // Retention 1s (tests): an upload used 2s ago is past both.
        let policy = Policy { retention_ms: 1000, max_total: Some(0), unnamed_grace_ms: 0 };
        let plan = decide(NOW, policy, &[up('a', 1, NOW - 2000)], &[], &[]);
        assert_eq!(deleted(&plan), [('a', Why::Retention)]);
        let plan = decide(NOW, policy, &[up('a', 1, NOW - 1000)], &[], &[]);
        assert_eq!(deleted(&plan), [('a', Why::MaxTotal)]);
    }

    /// Regression (outsider attack): an upload no pipeline named yet went at the first pass
    /// with a short retention or over the cap, before its pipeline (a client's next request,
    /// another coordinator's commit) arrived. An hour's grace from its last write.
    #[test]
    fn an_unnamed_upload_stays_for_the_grace_period_then_follows_the_rules() {
        let policy = Policy { retention_ms: 1000, max_total: Some(0), unnamed_grace_ms: H };
        let fresh = [up('a', 10, NOW - 10 * 60_000)];
        let plan = decide(NOW, policy, &fresh, &[], &[]);
        assert_eq!((deleted(&plan), plan.kept, plan.over_cap_bytes), (vec![], 1, 10));
        let old = [up('a', 10, NOW - 2 * H)];
        assert_eq!(deleted(&decide(NOW, policy, &old, &[], &[])), [('a', Why::Retention)]);
        // Named by a finished pipeline, the grace is not its to claim: the usual rules.
        let named = [used('a', 1, 0, NOW - 10 * 60_000)];
        assert_eq!(deleted(&decide(NOW, policy, &fresh, &named, &[])), [('a', Why::Retention)]);
    }

    #[test]
    fn stale_temporary_files_go_and_uses_of_deleted_uploads_are_ignored() {
        let temps = [
            TempFile { name: ".tmp-old".into(), bytes: 5, modified_ms: NOW - 2 * H },
            TempFile { name: ".tmp-live".into(), bytes: 5, modified_ms: NOW - 1000 },
        ];
        let plan = decide(NOW, week(), &[], &[used('q', 1, 1, NOW)], &temps);
        assert_eq!(plan.delete_temp, [".tmp-old"]);
        assert_eq!((plan.kept, plan.pinned), (0, 0));
    }

    proptest! {
        /// Whatever the facts: a pinned upload never goes, every upload is either kept or
        /// deleted once, and with a cap the total kept is under it unless only pinned or fresh
        /// uploads are left.
        #[test]
        fn pinned_never_go_and_the_cap_holds_where_it_can(
            ups in prop::collection::vec((0u8..12, 1u64..1000, 0i64..20 * D), 0..12),
            uses in prop::collection::vec((0u8..12, 0u64..3, 0i64..20 * D), 0..12),
            retention in 0i64..10 * D,
            cap in prop::option::of(0u64..5000),
            grace in prop_oneof![Just(0i64), 0i64..2 * D],
        ) {
            let now = 20 * D;
            let c = |n: u8| char::from(b'a' + n);
            let mut uploads: Vec<StoredUpload> = ups.iter().map(|&(n, b, m)| up(c(n), b, m)).collect();
            uploads.sort_by(|a, b| a.id.cmp(&b.id));
            uploads.dedup_by(|a, b| a.id == b.id);
            let uses: Vec<PipelineUse> =
                uses.iter().enumerate().map(|(i, &(n, u, at))| used(c(n), i as i64, u, at)).collect();
            let policy = Policy { retention_ms: retention, max_total: cap, unnamed_grace_ms: grace };
            let plan = decide(now, policy, &uploads, &uses, &[]);
            let pinned: std::collections::BTreeSet<&str> =
                uses.iter().filter(|u| u.unfinished_jobs > 0).map(|u| u.upload.as_str()).collect();
            for d in &plan.delete {
                prop_assert!(!pinned.contains(d.id.as_str()), "pinned {} deleted", d.id);
                let u = uploads.iter().find(|u| u.id == d.id).unwrap();
                let named = uses.iter().any(|p| p.upload == d.id);
                prop_assert!(named || now - u.modified_ms >= grace, "unnamed {} deleted within the grace", d.id);
            }
            prop_assert_eq!(plan.delete.len() as u64 + plan.kept, uploads.len() as u64);
            let total: u64 = uploads.iter().map(|u| u.bytes).sum();
            let freed: u64 = plan.delete.iter().map(|d| d.bytes).sum();
            prop_assert_eq!(total - freed, plan.kept_bytes);
            if let Some(cap) = cap {
                let deleted: std::collections::BTreeSet<&str> = plan.delete.iter().map(|d| d.id.as_str()).collect();
                let fresh = retention.min(FRESH_MS);
                let movable = uploads.iter().any(|u| {
                    let last = uses.iter().filter(|p| p.upload == u.id).map(|p| p.last_active_ms).fold(u.modified_ms, i64::max);
                    let in_grace = !uses.iter().any(|p| p.upload == u.id) && now - u.modified_ms < grace;
                    !deleted.contains(u.id.as_str()) && !pinned.contains(u.id.as_str()) && now - last >= fresh && !in_grace
                });
                prop_assert!(plan.kept_bytes <= cap || !movable, "over the cap with a deletable upload left: {plan:?}");
            }
        }
    }
}
