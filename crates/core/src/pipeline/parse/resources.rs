//! The fields of a step that say what it needs from a host: `gpus:`/`gpu:` (memory, compute
//! capability, model, driver and CUDA constraints) and `resources:` (memory, CPUs, pids).
//!
//! Only the request is checked here; whether any host can satisfy it is placement's question
//! (`crate::placement`), not this module's.

use super::{int_value, join, quoted, Ctx, Kind, Node, Value, GPU_KEYS, RESOURCES_KEYS};
use crate::gpu::{CmpOp, ComputeCapability, Constraint, GpuRequirements, Version};
use crate::pipeline::Resources;
use crate::quantity::Bytes;

impl Ctx<'_> {
    /// `gpu:`; the bool says whether any property was set.
    pub(super) fn gpu(&mut self, node: &Node, path: &str) -> Option<(GpuRequirements, bool)> {
        if int_value(node).is_some() {
            let n = node.scalar_text().unwrap_or_default();
            self.err(
                node.pos,
                path,
                format!("expected a map of GPU properties, got a number ({n}); for a GPU count write `gpus: {n}`"),
            );
            return None;
        }
        let fields = self.record(node, path, "a map of GPU properties, like {memory: \">=40GiB\"}", GPU_KEYS)?;
        let mut g = GpuRequirements::default();
        let mut ok = true;
        let any = !fields.is_empty();
        for (name, _, v) in fields {
            let p = join(path, name);
            let p = p.as_str();
            let good = match name {
                "memory" => self
                    .constraint(v, p, "a memory constraint like \">=40GiB\"", |s| {
                        s.parse::<Bytes>()
                            .ok()
                            .filter(|b| b.0 > 0 && !s.bytes().all(|c| c.is_ascii_digit() || c == b'.'))
                    })
                    .map(|c| g.memory = Some(c)),
                "compute_capability" => self
                    .constraint(v, p, "a compute capability constraint like \">=8.0\"", parse_compute_capability)
                    .map(|c| g.compute_capability = Some(c)),
                "driver" => self
                    .constraint(v, p, "a driver version constraint like \">=535\" or \">=535.104\"", Version::parse)
                    .map(|c| g.driver = Some(c)),
                "cuda" => self
                    .constraint(v, p, "a CUDA version constraint like \">=12.1\"", Version::parse)
                    .map(|c| g.cuda = Some(c)),
                "model" => self.word(v, p, "a model pattern").map(|m| g.model = Some(m)),
                "mig" => self.word(v, p, "a MIG profile").and_then(|m| {
                    if m.chars().any(char::is_whitespace) {
                        self.err(v.pos, p, format!("expected a MIG profile like \"1g.10gb\", got {}", quoted(&m)));
                        None
                    } else {
                        g.mig_profile = Some(m);
                        Some(())
                    }
                }),
                _ => Some(()),
            };
            ok &= good.is_some();
        }
        ok.then_some((g, any))
    }

    /// `op value`, where a missing operator means `>=`. Numbers are taken as text, so that
    /// `cuda: 12.1` and `driver: 535` work unquoted.
    pub(super) fn constraint<T>(
        &mut self,
        node: &Node,
        path: &str,
        expected: &str,
        parse_value: impl Fn(&str) -> Option<T>,
    ) -> Option<Constraint<T>> {
        let text = match &node.value {
            Value::Scalar(Kind::Str | Kind::Int | Kind::Float, t) => t.as_str(),
            _ => {
                self.type_err(node, path, expected);
                return None;
            }
        };
        let (op, rest) = CmpOp::split(text);
        match parse_value(rest) {
            Some(value) => Some(Constraint { op, value }),
            None => {
                self.err(node.pos, path, format!("expected {expected}, got {}", quoted(text)));
                None
            }
        }
    }

    pub(super) fn resources(&mut self, node: &Node, path: &str) -> Option<Resources> {
        let fields = self.record(node, path, "a map like {memory: 8GiB, cpus: 2, pids: 512}", RESOURCES_KEYS)?;
        let mut r = Resources::default();
        let mut ok = true;
        for (name, _, v) in fields {
            let p = join(path, name);
            let p = p.as_str();
            let good = match name {
                "memory" => match v
                    .scalar_text()
                    .filter(|_| matches!(v.value, Value::Scalar(Kind::Str | Kind::Int | Kind::Float, _)))
                {
                    Some(t) => self.size(t, v, p, "expected a size like 8GiB or 512MiB").map(|b| r.memory = Some(b)),
                    None => {
                        self.type_err(v, p, "a size like 8GiB or 512MiB");
                        None
                    }
                },
                "cpus" => self.cpus(v, p).map(|m| r.cpu_millis = Some(m)),
                "pids" => {
                    self.int_in(v, p, 1, i64::from(u32::MAX), "a process limit").map(|n| r.pids = u32::try_from(n).ok())
                }
                _ => Some(()),
            };
            ok &= good.is_some();
        }
        ok.then_some(r)
    }

    pub(super) fn cpus(&mut self, node: &Node, path: &str) -> Option<u32> {
        const EXPECTED: &str = "expected a number of CPUs greater than 0, like 2 or 1.5";
        let n = match &node.value {
            Value::Scalar(Kind::Int | Kind::Float, t) => {
                t.parse::<f64>().ok().or_else(|| int_value(node).map(|n| n as f64))
            }
            _ => None,
        };
        let millis = n.filter(|x| x.is_finite() && *x > 0.0).map(|x| (x * 1000.0).round());
        match millis {
            Some(m) if m >= 1.0 && m <= f64::from(u32::MAX) => Some(m as u32),
            _ => {
                self.err(node.pos, path, format!("{EXPECTED}, got {}", node.describe()));
                None
            }
        }
    }
}

fn parse_compute_capability(s: &str) -> Option<ComputeCapability> {
    let (major, minor) = s.split_once('.').unwrap_or((s, "0"));
    let digits = |p: &str| !p.is_empty() && p.len() <= 3 && p.bytes().all(|b| b.is_ascii_digit());
    if !digits(major) || !digits(minor) {
        return None;
    }
    Some(ComputeCapability { major: major.parse().ok()?, minor: minor.parse().ok()? })
}
