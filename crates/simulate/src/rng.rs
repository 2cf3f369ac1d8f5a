//! A small seeded random number generator (SplitMix64) and the distributions the simulator
//! draws from. Written here rather than taken from `rand` so a seed gives the same trace and
//! the same figures on every platform and every version of every dependency.

/// SplitMix64: fast, 64-bit state, good enough statistics for a simulation.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    /// An independent stream for one purpose (fleet, kind of draw), so adding draws of one
    /// kind does not shift the others.
    pub fn fork(&self, stream: u64) -> Rng {
        let mut r = Rng(self.0 ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
        r.next_u64();
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in [lo, hi].
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Exponential with the given rate (events per unit); infinite for rate 0.
    pub fn exp(&mut self, rate: f64) -> f64 {
        if rate <= 0.0 {
            return f64::INFINITY;
        }
        -(1.0 - self.f64()).ln() / rate
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.f64();
        let u2 = self.f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Log-normal with the given median and shape.
    pub fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        median * (sigma * self.normal()).exp()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_numbers_and_sane_moments() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        assert_eq!((a.next_u64(), a.next_u64()), (b.next_u64(), b.next_u64()));
        let mut r = Rng::new(1);
        let n = 100_000;
        let mean_u: f64 = (0..n).map(|_| r.f64()).sum::<f64>() / n as f64;
        assert!((mean_u - 0.5).abs() < 0.01, "{mean_u}");
        let mean_e: f64 = (0..n).map(|_| r.exp(2.0)).sum::<f64>() / n as f64;
        assert!((mean_e - 0.5).abs() < 0.01, "{mean_e}");
        let mut logs: Vec<f64> = (0..n).map(|_| r.lognormal(90.0, 0.3)).collect();
        logs.sort_by(f64::total_cmp);
        let median = logs[n / 2];
        assert!((median - 90.0).abs() < 2.0, "{median}");
        assert!((0..1000).all(|_| (3..=5).contains(&r.range(3, 5))));
    }
}
