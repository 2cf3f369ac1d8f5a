//! The job's walls as seen through the whole system: memory, disk quotas, slot uids, ready sandboxes, credentials, unsandboxed steps and limits an agent cannot enforce.

use super::*;

#[test]
fn a_job_over_its_memory_limit_fails_with_out_of_memory_and_a_fork_bomb_is_contained() {
    let (_dir, _server, _agent, api) = one_agent("30s", "a1", &["--isolation", isolation()]);
    let p = api.submit(
        r#"
steps:
  - key: hog
    resources: {memory: 64MiB}
    command: python3 -c "b = bytearray(300 * 1024 * 1024); print(len(b))"
  - key: bomb
    resources: {pids: 32, memory: 256MiB}
    timeout: 20s
    command: "f() { f | f & }; f; sleep 2; echo survived"
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    let hog = &done.jobs[0];
    assert_eq!(hog.state, JobState::Failed, "{}", hog.reason);
    assert_eq!(hog.reason, "out of memory (limit 64 MiB)");
    // The fork bomb hits the pids limit; the machine (and this test) carry on, and nothing of
    // it is left afterwards.
    let bomb = &done.jobs[1];
    assert!(bomb.state.is_terminal(), "{bomb:?}");
    wait_until("the fork bomb's processes to be gone", Duration::from_secs(20), || processes_with("f | f").is_empty());
}

/// Issue 9: a job filling its workspace stops at its disk quota ("disk quota exceeded"), not
/// at the host's disk; the next job of the slot starts with an empty workspace and its whole
/// quota. The agent's mounts go with it when it is killed.
#[test]
fn a_job_filling_its_workspace_stops_at_its_disk_quota_and_the_host_disk_is_untouched() {
    if !nix::unistd::geteuid().is_root() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: system tests run as root");
        eprintln!("SKIP: slot disks need a root agent");
        return;
    }
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let mut agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--isolation", isolation(), "--slots", "1", "--job-disk", "64MiB"],
    );
    let api = server.api();
    api.wait_agents(1, T);
    assert!(api.agents()[0].isolation.contains("a 64 MiB disk per slot"), "{}", api.agents()[0].isolation);
    let host_free =
        || nix::sys::statvfs::statvfs(dir.path()).map(|s| s.blocks_available() * s.fragment_size()).unwrap();
    let before = host_free();
    let p = api.submit("steps:\n  - key: fill\n    command: head -c 200000000 /dev/zero > big\n");
    let done = api.wait_pipeline(p.id, T);
    let fill = &done.jobs[0];
    assert_eq!(fill.state, JobState::Failed, "{fill:?}");
    assert!(fill.reason.starts_with("disk quota exceeded (limit 64 MiB)"), "{}", fill.reason);
    let after = host_free();
    assert!(before.saturating_sub(after) < 100 << 20, "the host disk lost {} bytes", before.saturating_sub(after));
    let p = api.submit(
        r#"
steps:
  - key: next
    command: |
      test ! -e big && echo "workspace empty"
      head -c 40000000 /dev/zero > fits && echo "40 MB fit"
"#,
    );
    let done = api.wait_pipeline(p.id, T);
    let next = &done.jobs[0];
    assert_eq!(next.state, JobState::Succeeded, "{next:?}");
    let log = api.log_text(next.id);
    assert!(log.contains("workspace empty") && log.contains("40 MB fit"), "{log}");
    // Killed, the agent leaves no mount behind.
    let mounts_of = |d: &std::path::Path| {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| l.contains(&*d.to_string_lossy()))
            .count()
    };
    agent.kill9();
    wait_until("the slot disk to be unmounted", T, || mounts_of(dir.path()) == 0);
}

/// Outsider finding (issue 9): a job that filled its slot's disk to the last block with many
/// files in a subdirectory left a workspace the agent could not remove (emptying a directory
/// moves its entries up, which needs a new directory block), and every later job on the slot
/// failed with "No space left on device" until the agent restarted.
#[test]
fn a_slot_disk_filled_to_the_last_block_is_emptied_for_the_next_job() {
    if !nix::unistd::geteuid().is_root() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: system tests run as root");
        eprintln!("SKIP: slot disks need a root agent");
        return;
    }
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--isolation", isolation(), "--slots", "1", "--job-disk", "64MiB"],
    );
    let api = server.api();
    api.wait_agents(1, T);
    let fill = r#"
steps:
  - key: fill
    command: |
      set +e
      mkdir d && cd d
      for i in $(seq 1 2500); do : > "file-with-a-rather-long-name-to-grow-the-directory-$i"; done
      head -c 100000000 /dev/zero > big 2>/dev/null
      for i in $(seq 1 500); do echo x > "s$i" 2>/dev/null || break; done
      for i in $(seq 1 500); do mkdir "m$i" 2>/dev/null || break; done
      df -k . | tail -1
      exit 0
"#;
    // And (outsider round 2) a directory of hundreds of thousands of hard links: entries that
    // cost no inode, so only the disk's blocks bound them, then the rest of the disk filled.
    let links = r#"
steps:
  - key: links
    command: |
      python3 - <<'PY'
      import os, itertools, string
      os.mkdir('d'); os.mkdir('e'); ch = string.ascii_letters + string.digits; b = None; c = n = 0
      try:
        for L in (1, 2, 3, 4):
          for t in itertools.product(ch, repeat=L):
            if b is None or c >= 64000: b = 'e/b%d' % n; open(b, 'w').close(); c = 0
            os.link(b, 'd/' + ''.join(t)); c += 1; n += 1
      except OSError as x: print(n, x)
      try:
        with open('e/big', 'wb') as f:
          while 1: f.write(b'x' * 65536)
      except OSError as x: print(x)
      PY
"#;
    for attack in [fill, links] {
        let done = api.wait_pipeline(api.submit(attack).id, T);
        assert!(done.jobs[0].state.is_terminal(), "{:?}", done.jobs[0]);
        next_jobs_run(&api);
    }
}

#[test]
fn a_sandboxed_job_cannot_read_the_agents_credential_or_host_keys() {
    if isolation() != "bubblewrap" {
        return;
    }
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let agent_dir = dir.path().join("agent");
    let _agent = Agent::start(&server, &agent_dir, "a1", &["--isolation", "bubblewrap"]);
    let api = server.api();
    api.wait_agents(1, T);
    let cred = agent_dir.join("agent.json");
    assert!(cred.exists());
    let yaml = format!(
        "steps:\n  - key: peek\n    command:\n      - \"if cat {cred} 2>/dev/null; then echo LEAK-CRED; fi\"\n      - \"if ls -A /etc/ssl/private 2>/dev/null | grep -q .; then echo LEAK-KEYS; fi\"\n      - \"if cat /etc/shadow 2>/dev/null; then echo LEAK-SHADOW; fi\"\n      - \"if ls {server_dir} 2>/dev/null; then echo LEAK-SERVER; fi\"\n      - echo looked\n",
        cred = cred.display(),
        server_dir = server.data_dir.display()
    );
    let p = api.submit(&yaml);
    let j = api.wait_job(p.jobs[0].id, "done", T, |j| j.state.is_terminal());
    assert_eq!(j.state, JobState::Succeeded, "{}", j.reason);
    assert_eq!(api.log_text(j.id), "looked\n");
}

#[test]
fn an_agent_runs_no_unsandboxed_step_unless_started_with_allow_unsandboxed() {
    // The default: no flag needed to refuse `sandbox: none` (issue 9: it was allowed).
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(&server, &dir.path().join("agent"), "strict", &["--isolation", isolation()]);
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: host\n    sandbox: none\n    queue_timeout: 2s\n    command: echo on-the-host\n  - key: boxed\n    command: echo boxed\n");
    let done = api.wait_pipeline(p.id, T);
    let (host, boxed) = (&done.jobs[0], &done.jobs[1]);
    assert_eq!(boxed.state, JobState::Succeeded);
    assert_eq!(host.state, JobState::TimedOut);
    assert!(host.reason.contains("needs an agent that allows `sandbox: none`"), "{}", host.reason);
    assert!(host.started_at_ms.is_none());
}

/// Issue 9 (speed): an idle slot holds its next job's sandbox, already started in its cgroup
/// and as its uid (and, beside it, a waiting shell for jobs laid out otherwise); the job
/// starts in that sandbox, and a fresh pair waits once the job is gone. Nothing else ever
/// runs as the slot's uid while it is idle.
#[test]
fn a_slots_next_job_starts_in_its_ready_sandbox_and_nothing_else_runs_as_the_slots_uid() {
    if isolation() != "bubblewrap" || !nix::unistd::geteuid().is_root() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: system tests run as root with bubblewrap");
        eprintln!("SKIP: warm starts need a root agent with bubblewrap");
        return;
    }
    let uid = 1_620_000_000 + (std::process::id() % 50_000) * 16;
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let uids = format!("{uid}-{}", uid + 1);
    let _agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--isolation", "bubblewrap", "--slots", "1", "--job-uids", &uids, "--job-disk", "none"],
    );
    let api = server.api();
    api.wait_agents(1, T);
    wait_until_or(
        "the slot's waiting processes",
        T,
        || idle_slot(uid).is_some(),
        || format!("{:?}", live_processes_of_uid(uid)),
    );
    let (shell, ready) = idle_slot(uid).unwrap();
    let p = api.submit("steps:\n  - key: a\n    command: [sleep 2, echo ran-in-the-ready-sandbox]\n");
    // The job runs inside the ready sandbox (a descendant of its bwrap); the shell is gone.
    let inside_ready = || {
        live_processes_of_uid(uid).iter().any(|(pid, cmd)| {
            let mut p = *pid;
            let mut chain = 0;
            while let Some(parent) = parent_of(p).filter(|_| chain < 8) {
                if parent == ready {
                    return cmd.contains("sleep 2");
                }
                (p, chain) = (parent, chain + 1);
            }
            false
        })
    };
    wait_until_or("the job in the ready sandbox", T, inside_ready, || format!("{:?}", live_processes_of_uid(uid)));
    // Killed at the hand-over (SIGKILL takes a moment to land): gone, not waiting beside the job.
    wait_until_or(
        "the waiting shell to be gone",
        T,
        || !live_processes_of_uid(uid).iter().any(|(p, _)| *p == shell),
        || format!("{:?}", live_processes_of_uid(uid)),
    );
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Succeeded, "{:?}", done.jobs[0]);
    assert!(api.log_text(done.jobs[0].id).contains("ran-in-the-ready-sandbox"));
    // Then exactly one new pair, and nothing else of the uid.
    wait_until_or(
        "a fresh pair of waiting processes and nothing else",
        T,
        || idle_slot(uid).is_some_and(|(s, r)| s != shell && r != ready),
        || format!("{:?}", live_processes_of_uid(uid)),
    );
    // A job laid out otherwise (no network) starts from the waiting shell: it becomes the job's bwrap.
    let (shell, ready) = idle_slot(uid).unwrap();
    let p =
        api.submit("steps:\n  - key: b\n    network: none\n    command: [sleep 2, echo ran-from-the-waiting-shell]\n");
    wait_until_or(
        "the waiting shell to become the job",
        T,
        || {
            std::fs::read_to_string(format!("/proc/{shell}/cmdline"))
                .is_ok_and(|c| c.contains("bwrap") && c.contains("bash"))
        },
        || format!("{:?}", live_processes_of_uid(uid)),
    );
    wait_until_or(
        "the ready sandbox to be gone",
        T,
        || !live_processes_of_uid(uid).iter().any(|(p, _)| *p == ready),
        || format!("{:?}", live_processes_of_uid(uid)),
    );
    let done = api.wait_pipeline(p.id, T);
    assert_eq!(done.jobs[0].state, JobState::Succeeded, "{:?}", done.jobs[0]);
    assert!(api.log_text(done.jobs[0].id).contains("ran-from-the-waiting-shell"));
}

/// Issue 9: nothing of a root agent outlives it, however it ends: its running job, the
/// waiting process of an idle slot, and the slot networks' holders and pasta (these ran on
/// until another agent took the same uids).
#[test]
fn an_agent_killed_with_sigkill_leaves_no_process_of_its_slots_uids() {
    if isolation() != "bubblewrap" || !nix::unistd::geteuid().is_root() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: system tests run as root with bubblewrap");
        eprintln!("SKIP: slots need a root agent with bubblewrap");
        return;
    }
    let uid = 1_620_000_008 + (std::process::id() % 50_000) * 16;
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let uids = format!("{uid}-{}", uid + 3);
    let mut agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--isolation", "bubblewrap", "--slots", "2", "--job-uids", &uids, "--job-disk", "none"],
    );
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: a\n    command: sleep 3007771\n");
    api.wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running);
    let ours = || (uid..uid + 4).flat_map(live_processes_of_uid).collect::<Vec<_>>();
    // A running job, a waiting process for the idle slot, two holders with their pasta.
    wait_until_or("the slots' processes", T, || ours().len() >= 6, || format!("{:?}", ours()));
    // Killed without the Drop's clean-up of holder uids.
    let _ = agent.child.kill();
    let _ = agent.child.wait();
    wait_until_or(
        "every process of the slots' uids to be gone",
        Duration::from_secs(10),
        || ours().is_empty(),
        || {
            let detail = |pid: u32| {
                let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
                st.lines()
                    .filter(|l| ["PPid:", "NSpid:", "State:", "Uid:"].iter().any(|k| l.starts_with(k)))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            format!("{:?}", ours().into_iter().map(|(p, c)| (p, c, detail(p))).collect::<Vec<_>>())
        },
    );
}

/// bubblewrap arms the parent-death signal of a sandbox's pid 1 only once it has set the
/// sandbox up: an agent killed while a job's sandbox was starting left bwrap and the job
/// running as the slot's uid (CI, under load). Made certain here with a `bwrap` that starts
/// the real one from a process outside the agent's parent-death chain: the agent's reaper
/// ends it all the same.
#[test]
fn a_sandbox_outside_the_parent_death_chain_ends_with_its_killed_agent() {
    if isolation() != "bubblewrap" || !nix::unistd::geteuid().is_root() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "CI=true: system tests run as root with bubblewrap");
        eprintln!("SKIP: slots need a root agent with bubblewrap");
        return;
    }
    let real = std::env::split_paths(&std::env::var_os("PATH").unwrap())
        .map(|d| d.join("bwrap"))
        .find(|p| p.exists())
        .unwrap();
    let uid = 1_620_000_012 + (std::process::id() % 50_000) * 16;
    let dir = tempdir();
    let shim = dir.path().join("shim");
    std::fs::create_dir(&shim).unwrap();
    // The subshell is forked (no parent-death signal of its own) and stays (a command after
    // bwrap): bwrap's own --die-with-parent ties it to the subshell, not to the agent.
    std::fs::write(
        shim.join("bwrap"),
        format!("#!/bin/sh\nexec 3<&0\n( {} \"$@\" <&3 3<&-; exit $? ) &\nwait $!\n", real.display()),
    )
    .unwrap();
    std::fs::set_permissions(shim.join("bwrap"), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", shim.display(), std::env::var("PATH").unwrap());
    let server = Server::start(&dir.path().join("server"), "30s");
    let uids = format!("{uid}-{}", uid + 1);
    let mut agent = Agent::start_with_env(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--isolation", "bubblewrap", "--slots", "1", "--job-uids", &uids, "--job-disk", "none"],
        &[("PATH", path)],
    );
    let api = server.api();
    api.wait_agents(1, T);
    let p = api.submit("steps:\n  - key: a\n    command: sleep 3007772\n");
    api.wait_job(p.jobs[0].id, "running", T, |j| j.state == JobState::Running);
    let ours = || (uid..uid + 2).flat_map(live_processes_of_uid).collect::<Vec<_>>();
    wait_until("the job", T, || ours().iter().any(|(_, c)| c.starts_with("sleep 3007772")));
    let _ = agent.child.kill();
    let _ = agent.child.wait();
    // Outside the chain nothing takes the job along with the agent; its reaper ends it, and
    // everything else of the slot's uids.
    wait_until_or(
        "every process of the slot's uids to be gone",
        Duration::from_secs(20),
        || ours().is_empty(),
        || format!("{:?}", ours()),
    );
}

/// Issue 27 (outsider finding): a `sandbox: none` step of one repository ran beside another
/// repository's job and printed that job's secret into its own log. A job outside the sandbox
/// now shares its agent with no other repository: it waits until the other repository's job
/// has ended (and says for which job), then runs.
#[test]
fn a_job_outside_the_sandbox_never_runs_beside_another_repositorys_job() {
    let dir = tempdir();
    let ledger = shared_dir(&dir, "ledger");
    let server = Server::start(&dir.path().join("server"), "30s");
    let _agent = Agent::start(
        &server,
        &dir.path().join("agent"),
        "a1",
        &["--slots", "2", "--isolation", isolation(), "--allow-unsandboxed"],
    );
    let api = server.api();
    api.wait_agents(1, T);
    // Repository A: a sandboxed job that runs for a while and prints when it ends.
    let a = api.submit_from(
        "steps:\n  - key: a\n    command: [\"sleep 3\", \"date +%s.%N\"]\n",
        Some("https://github.com/acme/private.git"),
    );
    let a_job = a.jobs[0].id;
    api.wait_job(a_job, "repository A's job to run", T, |j| j.state == JobState::Running);
    // Repository B: a step outside the sandbox, which notes when it starts.
    let b = api.submit_from(
        &format!(
            "steps:\n  - key: b\n    sandbox: none\n    command: [\"date +%s.%N > {}/b-start\"]\n",
            ledger.display()
        ),
        Some("https://github.com/other/public.git"),
    );
    let b_job = b.jobs[0].id;
    let b_done = api.wait_job(b_job, "repository B's job to end", T, |j| j.state.is_terminal());
    assert_eq!(b_done.state, JobState::Succeeded, "{}", b_done.reason);
    let a_done = api.wait_job(a_job, "repository A's job to end", T, |j| j.state.is_terminal());
    assert_eq!(a_done.state, JobState::Succeeded, "{}", a_done.reason);
    let a_end: f64 = api.log_text(a_job).trim().parse().expect("A printed its end");
    let b_start: f64 = std::fs::read_to_string(ledger.join("b-start")).unwrap().trim().parse().unwrap();
    assert!(b_start >= a_end, "B ran outside the sandbox at {b_start} while A ran until {a_end}");
    let said = api.log_system(b_job);
    assert!(
        said.iter().any(|l| l.contains(&format!("waiting for job {a_job} of another repository"))),
        "B's log does not say what it waited for: {said:?}"
    );
}

/// Issue 26 (no silent loss of protection): an agent that is not root ran steps with
/// `resources:` limits unenforced, and only the agent's own output said so. Such a step now
/// waits with the reason; with `--allow-unenforced-limits` it runs, and its log says the limits
/// are not enforced. `gpuci jobs show`, its `--json` and the API list what was not enforced
/// for each job: no limits and no disk quota of the job's own.
#[test]
fn limits_an_agent_cannot_enforce_are_refused_unless_the_operator_allowed_them() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("server"), "30s");
    let agents = dir.path().join("agents");
    let Some(mut strict) = unprivileged_agent(&server, &agents, "strict", &["--slots", "1"]) else { return };
    let api = server.api();
    api.wait_agents(1, T);
    let limited = "steps:\n  - key: limited\n    resources: {memory: 1GiB}\n    command: [\"echo ran\"]\n";
    let p = api.submit(limited);
    let job = p.jobs[0].id;
    let waiting = api.wait_job(job, "the limited step's reason", T, |j| j.reason.contains("resources:"));
    assert_eq!(waiting.state, JobState::Queued, "{}", waiting.reason);
    assert!(waiting.reason.contains("--allow-unenforced-limits"), "{}", waiting.reason);
    // A step without limits runs there, and its log says that none are enforced.
    let plain = api.submit("steps:\n  - key: plain\n    command: [\"echo ran\"]\n");
    let done = api.wait_job(plain.jobs[0].id, "the plain step", T, |j| j.state.is_terminal());
    assert_eq!(done.state, JobState::Succeeded, "{}", done.reason);
    let said = api.log_system(done.id);
    if said.iter().all(|l| !l.contains("limits:")) {
        // This machine delegates cgroups to unprivileged users: limits hold, nothing to refuse.
        eprintln!("SKIP: an unprivileged agent can make job cgroups here: {said:?}");
        let _ = strict.kill();
        return;
    }
    assert!(said.iter().any(|l| l.contains("no memory, CPU or process limit is enforced")), "{said:?}");
    // An agent that is not root gives no slot a disk of its own either; the log says so too.
    assert!(said.iter().any(|l| l.starts_with("disk_quota: no disk quota")), "{said:?}");
    assert_eq!(unenforced_keys(&server, done.id), ["limits", "disk_quota"]);
    let listed = api.job(done.id).unenforced;
    assert!(listed[0].detail.contains("no memory, CPU or process limit is enforced"), "{listed:?}");
    let _ = strict.kill();
    let _ = strict.wait();

    let Some(mut lenient) =
        unprivileged_agent(&server, &agents, "lenient", &["--slots", "1", "--allow-unenforced-limits"])
    else {
        return;
    };
    let ran = api.wait_job(job, "the limited step on the lenient agent", T, |j| j.state.is_terminal());
    assert_eq!(ran.state, JobState::Succeeded, "{}", ran.reason);
    let said = api.log_system(job);
    assert!(
        said.iter().any(|l| l.contains("resources: are NOT enforced") && l.contains("--allow-unenforced-limits")),
        "{said:?}"
    );
    // What the log says, `gpuci jobs show` says in a block of its own, and so does the API.
    let shown = jobs_show(&server, job, false);
    let block = shown.split_once("NOT enforced:\n").map(|(_, b)| b).unwrap_or_else(|| panic!("{shown}"));
    let limits = block.lines().next().unwrap();
    assert!(
        limits.trim_start().starts_with("limits ")
            && limits.contains("resources: are NOT enforced")
            && limits.contains("--allow-unenforced-limits"),
        "{shown}"
    );
    assert!(block.lines().nth(1).is_some_and(|l| l.trim_start().starts_with("disk_quota ")), "{shown}");
    assert_eq!(unenforced_keys(&server, job), ["limits", "disk_quota"]);
    let listed = api.job(job).unenforced;
    assert!(listed[0].detail.contains("--allow-unenforced-limits"), "{listed:?}");
    let _ = lenient.kill();
    let _ = lenient.wait();
}

/// Issue 26, the other side: a job on a root agent that sets up everything (bubblewrap, job
/// cgroups, a disk and a network namespace per slot) went without nothing, and `gpuci jobs
/// show` and the API list nothing.
#[test]
fn a_job_on_a_fully_enforcing_agent_lists_nothing_unenforced() {
    if !nix::unistd::geteuid().is_root() || isolation() != "bubblewrap" {
        eprintln!("SKIP: a fully enforcing agent needs root and bubblewrap");
        return;
    }
    let (_dir, server, _agent, api) = one_agent("30s", "root", &["--slots", "1", "--isolation", "bubblewrap"]);
    let p = api.submit("steps:\n  - key: limited\n    resources: {memory: 1GiB}\n    command: [\"echo ran\"]\n");
    let done = api.wait_job(p.jobs[0].id, "the job on the root agent", T, |j| j.state.is_terminal());
    assert_eq!(done.state, JobState::Succeeded, "{}", done.reason);
    assert!(done.started_at_ms.is_some());
    assert_eq!(api.job(done.id).unenforced, vec![]);
    assert_eq!(unenforced_keys(&server, done.id), Vec::<String>::new(), "`--json` has the field, empty");
    let shown = jobs_show(&server, done.id, false);
    assert!(!shown.contains("NOT enforced"), "{shown}");
    let said = api.log_system(done.id);
    assert!(!said.iter().any(|l| l.contains("NOT enforced") || l.starts_with("disk_quota:")), "{said:?}");
}
