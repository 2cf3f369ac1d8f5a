//! What a fleet machine's agent is started with: the program (a local fleet runs this build's
//! executable) and the `gpuci agent` arguments a fleet's settings add.

/// This build's executable, for a local fleet's agents. One replaced since this process
/// started (an upgrade) reads `… (deleted)`: the new one at that path is meant.
pub(super) fn local_agent_program() -> String {
    match std::env::current_exe() {
        Ok(p) => {
            let p = p.display().to_string();
            p.strip_suffix(" (deleted)").map(String::from).unwrap_or(p)
        }
        Err(_) => "gpuci".into(),
    }
}

/// Default of a fleet's `leave_after_unreachable`: an agent on a machine gpuci made gives the
/// machine up when the coordinator has been gone this long (`gpuci agent
/// --leave-after-unreachable`), so a dead coordinator does not leave GPUs billing.
pub const DEFAULT_LEAVE_AFTER: &str = "10m";

/// The `gpuci agent` arguments a fleet's machines get besides server, name and tags: the
/// settings' `agent_args`, then `--leave-after-unreachable` (the setting
/// `leave_after_unreachable`, [`DEFAULT_LEAVE_AFTER`] unless given, `"off"` for none) and
/// `--on-leave` (the setting `on_leave`, e.g. `"shutdown -h now"`), unless `agent_args` names
/// them already.
pub fn agent_args(settings: &toml::Table) -> Vec<String> {
    let mut args: Vec<String> = settings
        .get("agent_args")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().filter_map(|w| w.as_str().map(String::from)).collect())
        .unwrap_or_default();
    let given = |flag: &str, args: &[String]| args.iter().any(|a| a == flag || a.starts_with(&format!("{flag}=")));
    if !given("--leave-after-unreachable", &args) {
        match settings.get("leave_after_unreachable").and_then(|v| v.as_str()) {
            Some("off") => {}
            Some(d) => args.extend(["--leave-after-unreachable".to_string(), d.to_string()]),
            None => args.extend(["--leave-after-unreachable".to_string(), DEFAULT_LEAVE_AFTER.to_string()]),
        }
    }
    if let (Some(cmd), false) = (settings.get("on_leave").and_then(|v| v.as_str()), given("--on-leave", &args)) {
        if args.iter().any(|a| a.starts_with("--leave-after-unreachable")) {
            args.extend(["--on-leave".to_string(), cmd.to_string()]);
        }
    }
    args
}
