//! Rolling upgrades: which coordinator may run on which schema.
//!
//! During a rolling upgrade a coordinator of version N+1 (a standby) migrates the shared
//! database while version N still leads it. N must keep working on the newer schema, so every
//! migration is additive (new tables, new columns with defaults, new indexes) for at least one
//! version; `tests` below refuses a migration that drops, renames or retypes anything, or adds
//! a `NOT NULL` column without a default, unless it has a line `-- gpuci: breaking` and raises
//! `schema_compat.oldest_reader` to its own version. A coordinator starting on a database
//! newer than itself runs on it when its own newest migration is at least `oldest_reader`, and
//! is refused with the versions in words otherwise ([`decide`]). sqlx alone would refuse any
//! database with a migration it does not know.

use sqlx::migrate::Migrator;

/// The error a coordinator too old for its database gets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "this database's schema is at migration {database}, made by a newer gpuci, and no longer works with this \
     coordinator (its newest migration is {ours}; the database needs {needs} or later): upgrade this coordinator"
)]
pub struct TooOld {
    pub database: i64,
    pub ours: i64,
    pub needs: i64,
}

/// Whether a coordinator whose newest migration is `ours` may run on a database whose newest
/// applied migration is `applied` (`None`: a new database) and whose `schema_compat` says
/// `oldest_reader` (`None`: no such table yet, a schema from before rolling upgrades).
pub fn decide(applied: Option<i64>, ours: i64, oldest_reader: Option<i64>) -> Result<(), TooOld> {
    match applied {
        Some(database) if database > ours => {
            // A database newer than the compat table is unknown to us: nothing vouches for it.
            let needs = oldest_reader.unwrap_or(database);
            if ours >= needs {
                Ok(())
            } else {
                Err(TooOld { database, ours, needs })
            }
        }
        _ => Ok(()),
    }
}

/// `base` with only its migrations up to `newest` (all of them with `i64::MAX`), tolerating
/// applied migrations it does not know — [`decide`] has judged those already.
pub(crate) fn migrator(base: &Migrator, newest: i64) -> Migrator {
    let migrations: Vec<_> = base.migrations.iter().filter(|m| m.version <= newest).cloned().collect();
    Migrator { migrations: migrations.into(), ignore_missing: true, ..Migrator::DEFAULT }
}

/// The newest migration `m` knows.
pub(crate) fn newest(m: &Migrator) -> i64 {
    m.migrations.iter().map(|m| m.version).max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_coordinator_runs_on_a_newer_schema_only_while_it_is_compatible() {
        assert_eq!(decide(None, 20, None), Ok(()), "a new database");
        assert_eq!(decide(Some(20), 20, Some(19)), Ok(()), "the same version");
        assert_eq!(decide(Some(18), 20, None), Ok(()), "ours is newer: we migrate it");
        assert_eq!(decide(Some(21), 20, Some(19)), Ok(()), "one version ahead, additive");
        let e = decide(Some(22), 20, Some(22)).expect_err("a breaking migration since");
        assert_eq!(e, TooOld { database: 22, ours: 20, needs: 22 });
        assert!(e.to_string().contains("upgrade this coordinator"), "{e}");
        assert!(decide(Some(21), 20, None).is_err(), "newer, and nothing vouches for it");
    }

    /// Every migration from the compat table on, in both backends: additive, or marked breaking
    /// and raising `oldest_reader` to its own version.
    #[test]
    fn migrations_after_the_compat_table_are_additive_or_marked_breaking() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
        let mut checked = 0;
        for (backend, since) in [("sqlite", 19), ("postgres", 18)] {
            let mut files: Vec<_> =
                std::fs::read_dir(root.join(backend)).expect("migrations dir").flatten().map(|e| e.path()).collect();
            files.sort();
            for path in files {
                let name = path.file_name().unwrap().to_string_lossy().to_string();
                let version: i64 = name.split('_').next().and_then(|v| v.parse().ok()).expect("NNNN_name.sql");
                if version < since {
                    continue;
                }
                let text = std::fs::read_to_string(&path).expect("readable");
                let problems = not_additive(&text);
                if text.lines().any(|l| l.trim() == "-- gpuci: breaking") {
                    let raise = format!("UPDATE schema_compat SET oldest_reader = {version}");
                    assert!(
                        text.to_uppercase().contains(&raise.to_uppercase()),
                        "{backend}/{name} is marked breaking but does not say `{raise}`"
                    );
                } else {
                    assert!(
                        problems.is_empty(),
                        "{backend}/{name} would break the coordinator one version older during a rolling upgrade: \
                         {problems:?} (make it additive, or mark it `-- gpuci: breaking` and raise oldest_reader)"
                    );
                }
                checked += 1;
            }
        }
        assert!(checked >= 2, "the compat migrations themselves are checked");
    }

    #[test]
    fn the_additive_check_finds_what_breaks_an_older_reader() {
        assert!(not_additive("CREATE TABLE t (a INTEGER NOT NULL);\nCREATE INDEX i ON t (a);").is_empty());
        assert!(not_additive("ALTER TABLE t ADD COLUMN b TEXT NOT NULL DEFAULT '';").is_empty());
        assert!(not_additive("-- we never DROP TABLE here\nALTER TABLE t ADD COLUMN c TEXT;").is_empty());
        for bad in [
            "DROP TABLE jobs;",
            "ALTER TABLE jobs DROP COLUMN reason;",
            "ALTER TABLE jobs RENAME COLUMN reason TO why;",
            "ALTER TABLE jobs RENAME TO jobs_old;",
            "ALTER TABLE jobs ALTER COLUMN reason TYPE INTEGER;",
            "ALTER TABLE jobs ALTER COLUMN reason SET NOT NULL;",
            "ALTER TABLE jobs ADD COLUMN b TEXT NOT NULL;",
            "alter table jobs add column b text not null;",
        ] {
            assert!(!not_additive(bad).is_empty(), "{bad}");
        }
    }

    /// What in `sql` an older coordinator could not live with.
    fn not_additive(sql: &str) -> Vec<String> {
        let code: String =
            sql.lines().map(|l| l.split("--").next().unwrap_or("")).collect::<Vec<_>>().join(" ").to_uppercase();
        let mut found = Vec::new();
        for statement in code.split(';') {
            let s = statement.split_whitespace().collect::<Vec<_>>().join(" ");
            for bad in ["DROP TABLE", "DROP COLUMN", "RENAME", "ALTER COLUMN", "SET NOT NULL"] {
                if s.contains(bad) {
                    found.push(format!("{bad} in `{s}`"));
                }
            }
            if s.contains("ADD COLUMN") && s.contains("NOT NULL") && !s.contains("DEFAULT") {
                found.push(format!("a NOT NULL column without a default in `{s}`"));
            }
        }
        found
    }
}
