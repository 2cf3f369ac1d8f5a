//! A stand-in for an Actions runner installation. Its `run.sh` speaks the test server's private
//! protocol (`/_test/runners/...`), never GitHub's, and needs only bash, coreutils, base64 and curl.

use std::path::Path;

/// `--jitconfig` (or `ACTIONS_RUNNER_INPUT_JITCONFIG`) is base64 of `"<server url> <runner id>"` (see `generate_jitconfig`).
const RUN_SH: &str = r#"#!/usr/bin/env bash
# Stand-in for the GitHub Actions runner's run.sh, written by gpuci-github-testserver for tests.
# Protocol: long-poll POST {url}/_test/runners/{id}/acquire (204: nothing yet, 410: runner deleted,
# 200: "JOB_ID<TAB>RUN_ID<TAB>NAME" then the job's bash script), run the script, then
# POST {url}/_test/runners/{id}/complete?job=JOB_ID&exit=STATUS. While the script runs, a cancelled
# job (GET {url}/_test/jobs/{job}/status says "completed") is killed, as the real runner does.
set -u

# Like the real runner (run-helper.sh): it will not run as root unless told to, and exits 0.
if [ "$(id -u)" = 0 ] && [ -z "${RUNNER_ALLOW_RUNASROOT:-}" ]; then
  echo "Must not run interactively with sudo" >&2
  exit 0
fi

dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# As the real runner: an input not given as an argument is read from ACTIONS_RUNNER_INPUT_<NAME>,
# and the variable is cleared once read.
jitconfig="${ACTIONS_RUNNER_INPUT_JITCONFIG:-}"
unset ACTIONS_RUNNER_INPUT_JITCONFIG
while [ $# -gt 0 ]; do
  case "$1" in
    --jitconfig) jitconfig="${2:-}"; shift; [ $# -gt 0 ] && shift ;;
    --jitconfig=*) jitconfig="${1#--jitconfig=}"; shift ;;
    *) shift ;;
  esac
done

mkdir -p "$dir/_diag" 2>/dev/null || true
log() {
  printf '[%s INFO Runner] %s\n' "$(date -u '+%Y-%m-%d %H:%M:%SZ')" "$*" >> "$dir/_diag/Runner.log" 2>/dev/null || true
}
stamp() { date -u '+%Y-%m-%d %H:%M:%SZ'; }

if [ -z "$jitconfig" ]; then
  echo "run.sh: --jitconfig is required" >&2
  log "no --jitconfig given"
  exit 2
fi
decoded="$(printf '%s' "$jitconfig" | base64 -d 2>/dev/null)" || decoded=""
url="${decoded%% *}"
runner_id="${decoded##* }"
case "$runner_id" in
  ''|*[!0-9]*) echo "run.sh: the JIT config is not one this test runner understands" >&2; log "bad jitconfig"; exit 2 ;;
esac

work="$dir/_work"
mkdir -p "$work" 2>/dev/null || { work="$PWD/_work"; mkdir -p "$work"; }

echo "√ Connected to GitHub"
echo ""
echo "Current runner version: '2.999.0-gpuci-test'"
echo "$(stamp): Listening for Jobs"
log "runner $runner_id connected to $url"

failures=0
while :; do
  code="$(curl -sS -X POST -o "$work/acquire.out" -w '%{http_code}' --max-time 30 \
    "$url/_test/runners/$runner_id/acquire" 2>>"$dir/_diag/Runner.log")" || code="000"
  case "$code" in
    200) break ;;
    204) failures=0 ;;
    410|404)
      echo "$(stamp): Runner was removed from GitHub; exiting"
      log "runner $runner_id removed (HTTP $code)"
      exit 1 ;;
    *)
      failures=$((failures + 1))
      log "acquire failed (HTTP $code), attempt $failures"
      if [ "$failures" -ge 30 ]; then
        echo "$(stamp): Cannot reach GitHub; exiting" >&2
        exit 1
      fi
      sleep 1 ;;
  esac
done

IFS=$'\t' read -r job_id run_id job_name < "$work/acquire.out"
script="$work/job-$job_id.sh"
tail -n +2 "$work/acquire.out" > "$script"
echo "$(stamp): Running job: $job_name"
log "running job $job_id ($job_name) of run $run_id"

jobdir="$work/job-$job_id"
mkdir -p "$jobdir"
# Job control gives the script its own process group, so a cancel can stop everything it started.
set -m
(cd "$jobdir" && GITHUB_ACTIONS=true GITHUB_RUN_ID="$run_id" GITHUB_JOB="$job_name" exec bash "$script") &
pid=$!
set +m

cancelled=0
ticks=0
while kill -0 "$pid" 2>/dev/null; do
  sleep 0.2
  ticks=$((ticks + 1))
  if [ $((ticks % 5)) -eq 0 ]; then
    state="$(curl -sS --max-time 5 "$url/_test/jobs/$job_id/status" 2>/dev/null)" || state=""
    if [ "$state" = "completed" ]; then
      cancelled=1
      log "job $job_id was cancelled; stopping it"
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
      break
    fi
  fi
done
wait "$pid" 2>/dev/null
status=$?

curl -sS -X POST -o /dev/null --max-time 30 \
  "$url/_test/runners/$runner_id/complete?job=$job_id&exit=$status" 2>>"$dir/_diag/Runner.log" || true

if [ "$cancelled" -eq 1 ]; then
  result="Canceled"
elif [ "$status" -eq 0 ]; then
  result="Succeeded"
else
  result="Failed"
fi
echo "$(stamp): Job $job_name completed with result: $result"
log "job $job_id finished: $result (exit $status)"
exit 0
"#;

const CONFIG_SH: &str = r#"#!/usr/bin/env bash
# gpuci-github-testserver's stand-in runner is registered just in time; use run.sh --jitconfig.
echo "config.sh: not supported by the test runner; use ./run.sh --jitconfig <config>" >&2
exit 1
"#;

const ENV_SH: &str = "#!/usr/bin/env bash\n# Nothing to record for the test runner.\nexit 0\n";

const LISTENER: &str = r#"#!/usr/bin/env bash
# `Runner.Listener run --jitconfig X` is what the real run.sh ends up calling; forward to run.sh.
[ "${1:-}" = "run" ] && shift
exec "$(dirname "${BASH_SOURCE[0]}")/../run.sh" "$@"
"#;

const WORKER: &str = "#!/usr/bin/env bash\necho 'Runner.Worker: not part of the test runner' >&2\nexit 1\n";

/// Writes a stand-in for the Actions runner's `run.sh` (plus `bin/` and a few files so the directory
/// looks like a runner install) into `dir`, which is created if missing.
pub fn install_fake_runner(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir.join("bin"))?;
    std::fs::create_dir_all(dir.join("externals"))?;
    for (path, content) in [
        ("run.sh", RUN_SH),
        ("config.sh", CONFIG_SH),
        ("env.sh", ENV_SH),
        ("bin/Runner.Listener", LISTENER),
        ("bin/Runner.Worker", WORKER),
    ] {
        write_executable(&dir.join(path), content)?;
    }
    std::fs::write(dir.join("bin/runnerversion"), "2.999.0-gpuci-test\n")?;
    std::fs::write(dir.join("externals/README"), "The test runner needs no externals.\n")?;
    Ok(())
}

/// Like [`install_fake_runner`], but its `run.sh` prints `message` on stderr and exits with `code`
/// without asking for a job, the way the real runner does when it will not run as root (exit 0,
/// `Must not run interactively with sudo`) or cannot start at all.
pub fn install_runner_that_exits(dir: &Path, code: u8, message: &str) -> std::io::Result<()> {
    install_fake_runner(dir)?;
    let quoted = message.replace('\'', r"'\''");
    let run_sh = format!(
        "#!/usr/bin/env bash\n# Stand-in for an Actions runner that exits without taking a job.\n\
         echo 'Starting the runner'\nprintf '%s\\n' '{quoted}' >&2\nexit {code}\n"
    );
    write_executable(&dir.join("run.sh"), &run_sh)
}

fn write_executable(path: &Path, content: &str) -> std::io::Result<()> {
    std::fs::write(path, content)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}
