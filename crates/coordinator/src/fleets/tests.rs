//! Tests of the fleets module's own helpers (the loop is tested end to end in `gpuci-cli`'s tests).

use super::agent_args;

fn table(text: &str) -> toml::Table {
    toml::from_str(text).expect("toml")
}

#[test]
fn machines_leave_by_default_when_the_coordinator_is_gone() {
    assert_eq!(agent_args(&table("")), ["--leave-after-unreachable", "10m"]);
    assert_eq!(
        agent_args(&table(
            "agent_args = [\"--slots\", \"2\"]\nleave_after_unreachable = \"30m\"\non_leave = \"shutdown -h now\""
        )),
        ["--slots", "2", "--leave-after-unreachable", "30m", "--on-leave", "shutdown -h now"]
    );
    assert_eq!(agent_args(&table("leave_after_unreachable = \"off\"\non_leave = \"poweroff\"")), Vec::<String>::new());
    // Given in agent_args already: not twice.
    assert_eq!(
        agent_args(&table("agent_args = [\"--leave-after-unreachable\", \"1m\"]")),
        ["--leave-after-unreachable", "1m"]
    );
}
