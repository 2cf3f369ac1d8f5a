//! How long an idle machine is kept before it is stopped (or deleted), and how long a stopped
//! one before it is deleted: rent or buy, from the fleet's own recent arrivals. Decided here
//! and nowhere else; [`super::decide`] applies it when the fleet sets no `idle_timeout` /
//! `stopped_timeout` of its own.
//!
//! **The rule (ski rental).** Keeping a machine is *renting*: it costs its price for every
//! second it waits for a job. Letting it go is *buying*: the next job that needs it pays once
//! for getting one back, in money (the seconds billed while it stops and starts again, or
//! boots) and in waiting (the seconds that job waits, priced as seconds of the machine it
//! waits for: [`WAIT_WEIGHT`]) where that wait is one the fleet's promise counts: a job
//! waits at most one boot (the wait goal). Write `B` for that price in seconds of rent:
//!
//! - idle → stopped: `B = stop + start` (billed while stopping and starting). The start the
//!   next job waits for (about a third of a boot) is within the promise and not priced (until
//!   issue 28, session 5, it was: `B = stop + start + start`, which kept T4s idle 60–240 s where
//!   the bill alone says 38–150 s, for a wait no goal counts). The stopped machine's disk is
//!   small beside it and left out;
//! - idle → stopped **during a capacity outage of every offer the fleet may buy**
//!   ([`FleetHistory::outage_since`]): a stopped machine cannot be started again until the
//!   outage ends, so the next job would wait the outage's rest as well, which passes the
//!   promise: `B = stop + start + rest`, the rest expected as long again as the outage has
//!   lasted so far ([`outage_rest_s`]);
//! - idle → deleted (a fleet that cannot stop): `B = boot + boot` (the job waits a boot);
//! - stopped → deleted: the rent is the disk (`stopped_price_per_hour`), and `B` is what a
//!   fresh boot costs more than a start: `2 × (boot − start) × price`, over the disk's price
//!   (the job that finds no stopped machine waits a boot instead of a start: the wait the
//!   promise is about, priced).
//!
//! Deterministic ski rental (let go after `B`) pays at most **2×** what the best choice in
//! hindsight pays for each gap, whatever the arrivals. gpuci uses a prediction, the
//! learning-augmented form of Purohit, Svitkina and Kumar ("Improving online algorithms via
//! ML predictions", NeurIPS 2018) with trust `λ = 1/2`: from the fleet's arrivals over the
//! last hour (idle) or day (stopped), the gap until this machine is next needed is predicted
//! as `machines waiting / arrival rate` (each waiting machine takes its turn). When that
//! gap is longer than `B` (buying is the better bet), the machine is let go early, after
//! `λB = B/2`; when it is shorter, late, after `B/λ = 2B`. Guarantee (per gap, in the cost
//! model above): at most **1 + 1/λ = 3×** the hindsight optimum whatever the arrivals (a gap
//! just past `B/2` pays `B/2 + B` against `B/2`; one just past `2B` pays `3B` against `B`), and
//! at most `1 + λ = 1.5×` when the prediction is on the right side of `B`. The cost model
//! prices waiting; the bill alone is at most that, plus nothing for waits.
//!
//! **Learned from the fleet's idle spells** (issue 28, session 30). With at least
//! [`MIN_SPELLS`] idle spells in the last day ([`FleetHistory::idle_spells`]: the fleet's
//! jobs as its demand, arrivals up and ends down), the idle hold is the one that would have
//! paid least over them in the same cost model ([`hindsight_hold`]): the best fixed hold of
//! the last day, which the prediction's `B/2` is not. It gives up the 3× bound (a hold of 0
//! pays `B` for a spell of a second). And stopped machines are kept at least the shortest
//! hold with which one job in twenty of the last day's at most would have waited a boot
//! ([`stopped_floor`]): the wait goal is a percentile, which a price per second of waiting
//! does not keep.
//!
//! What the rule needs is plain data the caller keeps ([`FleetHistory`]): arrival and end
//! times, and the boot and start times it has seen (defaults until it has seen some).

use super::{secs, Capacity, FleetSpec, IdleAction, ProviderKind, UnixSecs};
use serde::Serialize;

/// Boot (create → agent connected) assumed before a fleet has booted a machine: a GPU VM
/// image with the agent baked in.
pub const DEFAULT_BOOT_S: u64 = 120;
/// Start of a stopped machine → agent connected, assumed before one was seen (EC2: about a
/// third of a fresh boot, no image to pull).
pub const DEFAULT_START_S: u64 = 45;
/// Stop request → stopped (billed until then). Not learned: providers rarely say when.
pub const DEFAULT_STOP_S: u64 = 30;
/// A stopped machine's disk per hour when the config says nothing, USD: 100 GB (a GPU image
/// with drivers, CUDA and a container cache) of EBS gp3 at $0.08 per GB-month, 730 hours a
/// month (aws.amazon.com/ebs/pricing). The same default the simulator bills.
pub const DEFAULT_STOPPED_PRICE_PER_HOUR: f64 = 100.0 * 0.08 / 730.0;
/// What a second a job waits for a machine is worth, in seconds of that machine's price.
/// One: a user who would rather pay for an idle machine than wait for it values the wait at
/// least so (always-on runners are that choice, made for every second of the day). Applied
/// to waits the fleet's promise (at most one boot) is about: a boot instead of a start, an
/// outage's rest; not to the start of a stopped machine, which is within it.
pub const WAIT_WEIGHT: f64 = 1.0;
/// The arrivals the idle rule reads: the last hour.
pub const IDLE_WINDOW_S: u64 = 3600;
/// The arrivals the stopped rule reads (its gaps are hours): the last day. The caller keeps
/// at least this much of [`FleetHistory::arrivals`].
pub const STOPPED_WINDOW_S: u64 = 86_400;

/// What the rules remember of a fleet, kept by the caller (the coordinator's fleet loop, the
/// simulator) and handed in.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct FleetHistory {
    /// When jobs for this fleet arrived (queued), ascending; at least the last
    /// [`STOPPED_WINDOW_S`] of them.
    pub arrivals: Vec<UnixSecs>,
    /// When jobs that arrived left the fleet (ended on a machine, or were cancelled before
    /// one), ascending, kept as long as `arrivals`: with them, the fleet's idle spells
    /// ([`FleetHistory::idle_spells`]). Empty: the caller does not keep them, and the idle
    /// rule predicts from the arrival rate alone.
    pub ends: Vec<UnixSecs>,
    /// Mean seconds from create to connected of the fleet's recent boots; `None`: none seen.
    pub boot_s: Option<u64>,
    /// Mean seconds from start (of a stopped machine) to connected; `None`: none seen.
    pub start_s: Option<u64>,
    /// Arrivals per hour of the week over a longer past ([`super::profile`]); `None`: not
    /// kept by the caller.
    pub profile: Option<super::profile::ArrivalProfile>,
    /// Capacity outages of the fleet's offers as the fleet met them: a create or a start
    /// refused for want of capacity opens one ([`FleetHistory::refused`]), the provider taking
    /// a create or a start of that offer closes it ([`FleetHistory::took`]). The caller keeps
    /// it beside the offers' back-off.
    pub outages: Vec<OutageSeen>,
    /// The hold learned from the idle spells, as [`FleetHistory::relearn`] last found it (the
    /// caller refreshes it: finding the spells reads a day of arrivals and ends).
    pub learned_idle: Option<LearnedIdle>,
    /// [`FleetHistory::level_ups`] as [`FleetHistory::relearn`] last found it, and when (it
    /// replays a day of arrivals).
    pub learned_ups: Option<(UnixSecs, Vec<u32>)>,
}

/// The idle hold that would have paid least over the fleet's last day ([`hindsight_hold`]),
/// when last worked out.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LearnedIdle {
    pub at: UnixSecs,
    /// The price it was worked out for ([`idle_buy_s`]).
    pub buy_s: f64,
    /// `None`: too few spells to learn from (the prediction rule decides).
    pub after_s: Option<u64>,
    /// [`stopped_floor`] for the learned idle hold, where the stopped rule decides.
    pub stopped_floor: Option<(u64, String)>,
    /// Spells it was judged on, and how many of them were no longer than `after_s`.
    pub spells: usize,
    pub shorter: usize,
}

/// What [`FleetHistory::spell_walk`] finds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpellWalk {
    pub done: Vec<u64>,
    pub open: Vec<u64>,
    pub arrived: usize,
    pub fresh: usize,
}

/// Of a fleet's jobs, the share that may wait a boot: the wait goal is p95 ≤ one boot, and a
/// job that waits a boot waits about one (more or less); one in twenty keeps the 95th
/// percentile at a start or less whatever the boot times.
pub const BOOT_WAIT_SHARE: f64 = 0.05;

/// The least a stopped machine is kept so that at most [`BOOT_WAIT_SHARE`] of the last day's
/// jobs would have waited a boot, in seconds, and its words; `None` when no hold is needed
/// (the day's spells fit) or none can do it (the day's unavoidable boots spend the share).
pub fn stopped_floor(walk: &SpellWalk, idle_after_s: u64) -> Option<(u64, String)> {
    let allowed = (BOOT_WAIT_SHARE * walk.arrived as f64).floor() as usize;
    let left = allowed.checked_sub(walk.fresh)?;
    let mut rests: Vec<u64> = walk
        .done
        .iter()
        .filter(|&&g| g > idle_after_s)
        .map(|&g| (g - idle_after_s).saturating_sub(DEFAULT_STOP_S))
        .collect();
    if rests.len() <= left {
        return None;
    }
    rests.sort_unstable_by(|a, b| b.cmp(a));
    let hold = rests[left] + 1;
    Some((
        hold,
        format!(
            "stopped machines kept at least {} so that at most {left} more of the last day's {} jobs would have waited \
             a boot ({} did whatever was kept; p95 ≤ one boot allows {allowed})",
            secs(hold),
            walk.arrived,
            walk.fresh
        ),
    ))
}

/// How long a [`LearnedIdle`] is used after it was worked out.
pub const LEARNED_IDLE_FRESH_S: u64 = 600;

/// Whether something [`FleetHistory::relearn`] worked out at `at` is still used at `now`.
pub fn fresh(at: UnixSecs, now: UnixSecs) -> bool {
    at <= now && now < at.saturating_add(LEARNED_IDLE_FRESH_S)
}

/// One capacity outage of one offer and capacity type, as the fleet met it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct OutageSeen {
    pub offer: usize,
    pub capacity: Capacity,
    /// The first refusal.
    pub since: UnixSecs,
    /// The latest refusal.
    pub last: UnixSecs,
    /// When the provider took a create or a start of the offer again; `None`: not yet.
    pub over: Option<UnixSecs>,
}

/// How long the outages the fleet met are remembered (a week: the arrival profile's span).
pub const OUTAGES_KEPT_S: u64 = 7 * 86_400;

impl FleetHistory {
    /// Arrivals in `[now - window, now]`.
    pub fn arrivals_within(&self, now: UnixSecs, window: u64) -> usize {
        let from = now.saturating_sub(window);
        let a = self.arrivals.partition_point(|&t| t < from);
        let b = self.arrivals.partition_point(|&t| t <= now);
        b.saturating_sub(a)
    }

    /// Drop arrivals older than `now - keep` (amortized: only when they are many), and
    /// outages over for longer than [`OUTAGES_KEPT_S`].
    pub fn trim(&mut self, now: UnixSecs, keep: u64) {
        for times in [&mut self.arrivals, &mut self.ends] {
            let old = times.partition_point(|&t| t + keep < now);
            if old > 64 && old * 2 > times.len() {
                times.drain(..old);
            }
        }
        self.outages.retain(|o| o.over.unwrap_or(o.last).saturating_add(OUTAGES_KEPT_S) > now);
    }

    /// The provider refused a create or a start of `offer` at `capacity` for want of capacity.
    pub fn refused(&mut self, offer: usize, capacity: Capacity, now: UnixSecs) {
        match self.outages.iter_mut().find(|o| o.offer == offer && o.capacity == capacity && o.over.is_none()) {
            Some(o) => o.last = o.last.max(now),
            None => self.outages.push(OutageSeen { offer, capacity, since: now, last: now, over: None }),
        }
    }

    /// The provider took a create or a start of `offer` at `capacity`: its outage is over.
    pub fn took(&mut self, offer: usize, capacity: Capacity, now: UnixSecs) {
        for o in self.outages.iter_mut().filter(|o| o.offer == offer && o.capacity == capacity && o.over.is_none()) {
            o.over = Some(now);
        }
    }

    /// When the outage began that holds back every offer and capacity type the fleet may buy
    /// now, if one does (the latest beginning of them): no machine of the fleet can be created
    /// or started until it ends. An outage not refused again within
    /// [`super::backoff::FORGET_AFTER_S`] is taken as over, as the back-off forgets it.
    pub fn outage_since(&self, spec: &FleetSpec, now: UnixSecs) -> Option<UnixSecs> {
        let caps = spec.capacity.order(false);
        if spec.offers.is_empty() || caps.is_empty() {
            return None;
        }
        let mut latest = None::<UnixSecs>;
        for &cap in caps {
            for o in 0..spec.offers.len() {
                let open = self.outages.iter().find(|x| {
                    x.offer == o
                        && x.capacity == cap
                        && x.over.is_none()
                        && x.since <= now
                        && now < x.last.saturating_add(super::backoff::FORGET_AFTER_S)
                })?;
                latest = Some(latest.map_or(open.since, |l| l.max(open.since)));
            }
        }
        latest
    }
}

/// How long a machine is held in its state before the next step down, and why, in words
/// (shown in the fleet's decision notes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Hold {
    /// `None`: never (a stopped machine that costs nothing).
    pub after_s: Option<u64>,
    pub why: String,
}

/// The fleet's price per second of one machine: its first offer, at its first capacity type.
fn price_per_s(spec: &FleetSpec) -> f64 {
    let cap = spec.capacity.order(false).first().copied().unwrap_or(Capacity::OnDemand);
    spec.offers.first().map_or(0.0, |o| o.price(cap)) / 3600.0
}

fn times(h: Option<&FleetHistory>) -> (u64, u64) {
    let boot = h.and_then(|h| h.boot_s).unwrap_or(DEFAULT_BOOT_S);
    let start = h.and_then(|h| h.start_s).unwrap_or(DEFAULT_START_S);
    (boot, start)
}

/// Rent or buy with a prediction, trust 1/2: let go after `B/2` when the predicted gap is at
/// least `B`, else after `2B`.
fn threshold(buy_s: f64, predicted_gap_s: f64) -> (u64, bool) {
    let early = predicted_gap_s >= buy_s;
    let t = if early { buy_s / 2.0 } else { buy_s * 2.0 };
    (t.max(0.0).round() as u64, early)
}

/// `12 jobs in the last hour, one per idle machine every 5m00s`.
fn rate_words(arrivals: usize, window: u64, waiting: u32, gap: f64) -> String {
    let span = if window == IDLE_WINDOW_S { "hour" } else { "day" };
    if arrivals == 0 {
        return format!("no job in the last {span}");
    }
    let who = if waiting <= 1 { "one every" } else { "one per waiting machine every" };
    format!("{arrivals} job{} in the last {span}, {who} {}", if arrivals == 1 { "" } else { "s" }, secs(gap as u64))
}

/// How long an idle machine is kept, `idle` machines idle now (this one among them).
pub fn idle_hold(spec: &FleetSpec, h: Option<&FleetHistory>, idle: u32, now: UnixSecs) -> Hold {
    let verb = match spec.idle_action {
        IdleAction::Stop => "stop",
        IdleAction::Delete => "delete",
    };
    if let Some(t) = spec.idle_timeout_s {
        return Hold { after_s: Some(t), why: format!("idle → {verb} after {} (idle_timeout)", secs(t)) };
    }
    let (mut buy, mut parts) = idle_buy_s(spec, h);
    // In an outage of every offer the fleet may buy, a machine let go cannot be had again
    // until the outage ends: the next job that needs it waits the rest of the outage too.
    if let Some(since) = h.and_then(|h| h.outage_since(spec, now)) {
        let rest = outage_rest_s(since, now);
        buy += WAIT_WEIGHT * rest as f64;
        parts = format!(
            "{parts}, and the rest of a capacity outage of its offers ({} so far, so about {} more)",
            secs(now.saturating_sub(since)),
            secs(rest)
        );
    }
    let learned = h.and_then(|h| match &h.learned_idle {
        // Learned for about this price (the start and boot times it reads move a little
        // with each one seen; an outage's rest moves it far).
        Some(l) if (l.buy_s - buy).abs() <= 0.1 * buy && fresh(l.at, now) => {
            l.after_s.map(|t| (t, l.spells, l.shorter))
        }
        _ => {
            let l = hindsight_idle(&h.spell_walk(now, SPELLS_WINDOW_S), buy, now);
            l.after_s.map(|t| (t, l.spells, l.shorter))
        }
    });
    if let Some((t, spells, shorter)) = learned {
        return Hold {
            after_s: Some(t),
            why: format!(
                "idle → {verb} after {} (the hold that would have paid least over the last day's {spells} idle \
                 spells, {shorter} of them no longer; a {verb} pays back in {} of its price: {parts})",
                secs(t),
                secs(buy as u64)
            ),
        };
    }
    let n = h.map_or(0, |h| h.arrivals_within(now, IDLE_WINDOW_S));
    let gap = if n == 0 { f64::INFINITY } else { IDLE_WINDOW_S as f64 * f64::from(idle.max(1)) / n as f64 };
    let (t, early) = threshold(buy, gap);
    let bet = if early { "later than" } else { "sooner than" };
    Hold {
        after_s: Some(t),
        why: format!(
            "idle → {verb} after {} (rent or buy: {}, {bet} a {verb} pays back in {} of its price: {parts})",
            secs(t),
            rate_words(n, IDLE_WINDOW_S, idle, gap),
            secs(buy as u64)
        ),
    }
}

/// The idle spells the learned hold reads: the last day's.
pub const SPELLS_WINDOW_S: u64 = STOPPED_WINDOW_S;
/// Fewer spells than this in [`SPELLS_WINDOW_S`]: too few to learn from, the prediction
/// rule decides.
pub const MIN_SPELLS: usize = 20;

/// The hold, in seconds, that would have paid least over the idle spells `done` (lengths)
/// and `open` (still idle at the time: lengths so far), and how many spells it was judged
/// on: rent or buy per spell, `min(spell, hold)` of rent and `buy` more when the spell
/// outlasts the hold. Holds tried: 0 and each spell's length up to `2 × buy` (the longest
/// hold the prediction rule makes); the best is one of them. Spells longer than that, and
/// open ones already so long, cost `hold + buy` whatever the hold; shorter open spells are
/// left out (how they end is not known). Of equal costs, the longer hold (fewer restarts for
/// jobs to wait). `None` with fewer than [`MIN_SPELLS`].
pub fn hindsight_hold(buy: f64, done: &[u64], open: &[u64]) -> Option<(u64, usize)> {
    let cap = (2.0 * buy).max(0.0);
    let mut short: Vec<u64> = done.iter().copied().filter(|&g| (g as f64) <= cap).collect();
    short.sort_unstable();
    let long = done.len() - short.len() + open.iter().filter(|&&g| g as f64 > cap).count();
    let n = short.len() + long;
    if n < MIN_SPELLS {
        return None;
    }
    // Hold 0: every spell longer than 0 buys.
    let zero = short.iter().filter(|&&g| g == 0).count();
    let (mut best_t, mut best) = (0u64, (n - zero) as f64 * buy);
    let mut rented = 0.0;
    for (k, &g) in short.iter().enumerate() {
        rented += g as f64;
        if short.get(k + 1) == Some(&g) {
            continue;
        }
        let outlasting = (n - k - 1) as f64;
        let cost = rented + outlasting * (g as f64 + buy);
        if cost <= best + 1e-9 {
            (best_t, best) = (g, cost);
        }
    }
    Some((best_t, n))
}

/// The idle hold that would have paid least over the spells of `walk` at `buy`
/// ([`hindsight_hold`]); no hold with too few spells (or no ends kept).
fn hindsight_idle(walk: &SpellWalk, buy: f64, now: UnixSecs) -> LearnedIdle {
    let (after_s, spells, shorter) = match hindsight_hold(buy, &walk.done, &walk.open) {
        Some((t, n)) => (Some(t), n, walk.done.iter().filter(|&&g| g <= t).count()),
        None => (None, walk.done.len() + walk.open.len(), 0),
    };
    LearnedIdle { at: now, buy_s: buy, after_s, spells, shorter, stopped_floor: None }
}

/// How much longer an outage seen since `since` is expected to last at `now`: as long as it
/// has lasted (the median rest of a span known only by its age: Gott's delta-t argument, no
/// assumption on how long outages are), and at least the first capacity skip (an outage just
/// met has lasted at least until the fleet asks again).
pub fn outage_rest_s(since: UnixSecs, now: UnixSecs) -> u64 {
    now.saturating_sub(since).max(super::backoff::FIRST_CAPACITY_SKIP_S)
}

/// What letting an idle machine go costs the next job that needs it, in seconds of the
/// machine's rent (`B` of the module header), and its parts in words.
pub fn idle_buy_s(spec: &FleetSpec, h: Option<&FleetHistory>) -> (f64, String) {
    let (boot, start) = times(h);
    match spec.idle_action {
        // The start a job then waits is not priced: it is shorter than a boot, what the
        // fleet promises a job waits at most (see [`WAIT_WEIGHT`]).
        IdleAction::Stop => (
            (DEFAULT_STOP_S + start) as f64,
            format!("stop {} + start {}; a start's wait is within one boot", secs(DEFAULT_STOP_S), secs(start)),
        ),
        IdleAction::Delete => {
            (boot as f64 * (1.0 + WAIT_WEIGHT), format!("boot {} + the boot a job waits", secs(boot)))
        }
    }
}

/// How long a stopped machine is kept before it is deleted, `waiting` machines idle or
/// stopped now (this one among them).
pub fn stopped_hold(spec: &FleetSpec, h: Option<&FleetHistory>, waiting: u32, now: UnixSecs) -> Hold {
    if let Some(t) = spec.stopped_timeout_s {
        return Hold { after_s: Some(t), why: format!("stopped → delete after {} (stopped_timeout)", secs(t)) };
    }
    let disk_per_s = spec.stopped_price_per_hour / 3600.0;
    if disk_per_s <= 0.0 {
        return Hold { after_s: None, why: "stopped machines are kept: a stopped machine costs nothing here".into() };
    }
    let (boot, start) = times(h);
    let extra = boot.saturating_sub(start);
    let buy_usd = extra as f64 * (1.0 + WAIT_WEIGHT) * price_per_s(spec);
    let buy = buy_usd / disk_per_s;
    // The last day's arrivals, or the profile's next day when it expects more (stopped
    // machines are kept ahead of the usual busy hours: `super::profile`).
    let last_day = h.map_or(0, |h| h.arrivals_within(now, STOPPED_WINDOW_S));
    let next_day = h
        .and_then(|h| h.profile.as_ref())
        .and_then(|p| p.expected_within(now, STOPPED_WINDOW_S))
        .map_or(0, |e| e.round() as usize);
    let ahead = next_day > last_day;
    let n = last_day.max(next_day);
    let gap = if n == 0 { f64::INFINITY } else { STOPPED_WINDOW_S as f64 * f64::from(waiting.max(1)) / n as f64 };
    let (t, early) = threshold(buy, gap);
    let bet = if early { "later than" } else { "sooner than" };
    let mut said = rate_words(n, STOPPED_WINDOW_S, waiting, gap);
    if ahead {
        said = said.replace("in the last day", "expected in the next day (history)");
    }
    Hold {
        after_s: Some(t),
        why: format!(
            "stopped → delete after {} (rent or buy: {}, {bet} its disk (${:.4}/h) costs what a boot costs more than a \
             start (boot {} − start {}, billed and waited: ${buy_usd:.3}) in {})",
            secs(t),
            said,
            spec.stopped_price_per_hour,
            secs(boot),
            secs(start),
            secs(buy as u64)
        ),
    }
}

/// The stopped hold of the machine `place`-th in line to be used again (idle machines first,
/// then stopped ones, the most recently stopped first: the order [`super::decide`] starts
/// them in) while `in_use` machines are busy or booting. A fleet starts its stopped machines
/// one after another, so the third in line is needed only when three more jobs than the busy
/// machines run at once, which is rarer than one more: keeping it for the fleet's whole
/// arrival rate (as [`stopped_hold`] does) pays its disk for hours for a start that seldom
/// comes. The gap until it is needed is predicted from the fleet's own last day: each arrival
/// keeps a machine busy for the fleet's mean run time (from its arrival profile), and the
/// times the machines so in use went up to `n = in_use + place` are counted
/// ([`FleetHistory::level_ups`]); the predicted gap is the day over that count. Bursts (a push
/// that fans out into three shards) count as they came: three machines at once. The
/// rent-or-buy threshold and its bound are those of the module header, per machine. `None`
/// when the mean run time is not known (no arrival profile): then [`stopped_hold`] decides.
pub fn stopped_hold_in_line(
    spec: &FleetSpec,
    h: Option<&FleetHistory>,
    in_use: u32,
    place: u32,
    ups: &[u32],
    now: UnixSecs,
) -> Option<Hold> {
    if spec.stopped_timeout_s.is_some() || spec.stopped_price_per_hour <= 0.0 {
        return None;
    }
    let profile = h?.profile.as_ref()?;
    profile.mean_work_s()?;
    let n = in_use + place.max(1);
    let count = ups.get(n as usize - 1).copied().unwrap_or(0);
    let disk_per_s = spec.stopped_price_per_hour / 3600.0;
    let (boot, start) = times(h);
    let buy = boot.saturating_sub(start) as f64 * (1.0 + WAIT_WEIGHT) * price_per_s(spec) / disk_per_s;
    // The hours ahead are not the day's average: a profile that expects a quiet night (or a
    // busy morning) scales the day's count by the arrivals it expects within `B` against the
    // day's share of them.
    let last_day = h.map_or(0, |h| h.arrivals_within(now, STOPPED_WINDOW_S)) as f64;
    let scale = match profile.expected_within(now, buy.round() as u64) {
        Some(ahead) if last_day > 0.0 => ahead / (last_day * buy / STOPPED_WINDOW_S as f64),
        _ => 1.0,
    };
    let per_day = f64::from(count) * scale;
    let gap = if per_day > 0.0 { STOPPED_WINDOW_S as f64 / per_day } else { f64::INFINITY };
    let (t, early) = threshold(buy, gap);
    let bet = if early { "later than" } else { "sooner than" };
    Some(Hold {
        after_s: Some(t),
        why: format!(
            "stopped → delete after {} (rent or buy: {place} in line with {in_use} in use; the fleet went up to {n} \
             at once {count} time{} in the last day{}, {bet} its disk costs what a start saves over a boot in {})",
            secs(t),
            if count == 1 { "" } else { "s" },
            if (scale - 1.0).abs() > 0.05 {
                format!(", and the next {} usually brings {scale:.2}× the day's rate", secs(buy as u64))
            } else {
                String::new()
            },
            secs(buy as u64)
        ),
    })
}

impl FleetHistory {
    /// The fleet's idle spells that began in the last `window`: the fleet's jobs are its
    /// demand (an arrival one more, an end one fewer); a job that ends with `n` jobs in the
    /// fleet frees a machine that is needed again when `n` are next in it (the machine freed
    /// last is the first needed again). Returns the spells that ended (seconds) and those
    /// still open at `now` (seconds so far). Jobs are counted as machines (a machine running
    /// two one-GPU jobs counts twice). Pure: arrivals and ends alone. Empty without ends.
    pub fn idle_spells(&self, now: UnixSecs, window: u64) -> (Vec<u64>, Vec<u64>) {
        let w = self.spell_walk(now, window);
        (w.done, w.open)
    }

    /// [`FleetHistory::idle_spells`], and of the arrivals in the window, how many there were
    /// and how many found no spell to end (the fleet's jobs went above any level a machine
    /// was freed at: a machine had to be made or started for them whatever was kept).
    pub fn spell_walk(&self, now: UnixSecs, window: u64) -> SpellWalk {
        let (mut done, mut open) = (Vec::new(), Vec::new());
        let (mut arrived, mut fresh) = (0usize, 0usize);
        if self.ends.is_empty() {
            return SpellWalk { done, open, arrived, fresh };
        }
        let from = now.saturating_sub(window);
        let upto = |v: &[UnixSecs]| v.partition_point(|&t| t <= now);
        let (arrivals, ends) = (&self.arrivals[..upto(&self.arrivals)], &self.ends[..upto(&self.ends)]);
        // Spells open, lowest level on top: (level the end left, when).
        let mut stack: Vec<(usize, UnixSecs)> = Vec::new();
        let (mut i, mut j, mut level) = (0, 0, 0usize);
        while i < arrivals.len() || j < ends.len() {
            // At the same second an end comes first: a machine freed and taken at once.
            if j < ends.len() && (i == arrivals.len() || ends[j] <= arrivals[i]) {
                let t = ends[j];
                j += 1;
                // An end of a job that arrived before the arrivals kept: nothing to free.
                if level == 0 {
                    continue;
                }
                level -= 1;
                stack.push((level, t));
            } else {
                let t = arrivals[i];
                i += 1;
                let mut ended = false;
                if let Some(&(l, since)) = stack.last() {
                    if l == level {
                        stack.pop();
                        ended = true;
                        if since >= from {
                            done.push(t - since);
                        }
                    }
                }
                if t >= from {
                    arrived += 1;
                    fresh += usize::from(!ended);
                }
                level += 1;
            }
        }
        open.extend(stack.iter().filter(|(_, since)| *since >= from).map(|(_, since)| now - since));
        SpellWalk { done, open, arrived, fresh }
    }

    /// Work out again what the rules learn from a day of history: the learned idle hold
    /// ([`FleetHistory::learned_idle`], at the fleet's price of letting a machine go outside
    /// an outage, [`idle_buy_s`]; during one, [`idle_hold`] works it out for its higher price
    /// itself) and the level ups ([`FleetHistory::learned_ups`]). Each is used for
    /// [`LEARNED_IDLE_FRESH_S`] after; the coordinator calls this every pass, the simulator
    /// once a simulated minute.
    pub fn relearn(&mut self, spec: &FleetSpec, now: UnixSecs) {
        let (buy, _) = idle_buy_s(spec, Some(self));
        let walk = self.spell_walk(now, SPELLS_WINDOW_S);
        let mut learned = hindsight_idle(&walk, buy, now);
        if let Some(idle_after) = learned.after_s.filter(|_| {
            spec.idle_action == IdleAction::Stop
                && spec.stopped_timeout_s.is_none()
                && spec.stopped_price_per_hour > 0.0
        }) {
            learned.stopped_floor = stopped_floor(&walk, idle_after);
        }
        self.learned_idle = Some(learned);
        self.learned_ups = Some((now, self.level_ups(now)));
    }

    /// [`FleetHistory::level_ups`], as last worked out if that is fresh, else now.
    pub fn level_ups_fresh(&self, now: UnixSecs) -> Vec<u32> {
        match &self.learned_ups {
            Some((at, ups)) if fresh(*at, now) => ups.clone(),
            _ => self.level_ups(now),
        }
    }

    /// Over the last [`STOPPED_WINDOW_S`], how many times the machines kept busy by the
    /// arrivals (each for the fleet's mean run time, from its profile) went up to `n` at once,
    /// for `n` = 1, 2, … (index `n − 1`). Empty without a profile. Pure: arrivals alone.
    pub fn level_ups(&self, now: UnixSecs) -> Vec<u32> {
        let Some(run) = self.profile.as_ref().and_then(|p| p.mean_work_s()) else { return Vec::new() };
        let run = run.round().max(1.0) as u64;
        let from = now.saturating_sub(STOPPED_WINDOW_S);
        let a =
            &self.arrivals[self.arrivals.partition_point(|&t| t < from)..self.arrivals.partition_point(|&t| t <= now)];
        let mut ups: Vec<u32> = Vec::new();
        let (mut level, mut ended) = (0usize, 0usize);
        for (i, &t) in a.iter().enumerate() {
            // Ends (same run for all, so in arrival order) at or before this arrival first.
            while ended < i && a[ended] + run <= t {
                ended += 1;
                level -= 1;
            }
            level += 1;
            if ups.len() < level {
                ups.resize(level, 0);
            }
            ups[level - 1] += 1;
        }
        ups
    }
}

/// The idle action a fleet gets when its config names none: `stop` where the provider can
/// stop and restart the same machine and the fleet buys on-demand only (a spot instance is
/// not stopped and started again; a spot fleet deletes), else `delete`. An exec program
/// stops only when it says so (`stop = true` in `[fleet.settings]`).
pub fn default_idle_action(provider: ProviderKind, on_demand_only: bool, settings: &toml::Table) -> IdleAction {
    let can = match provider {
        ProviderKind::Exec => settings.get("stop").and_then(toml::Value::as_bool) == Some(true),
        p => p.can_stop(),
    };
    if can && on_demand_only {
        IdleAction::Stop
    } else {
        IdleAction::Delete
    }
}

/// The stopped machine's price per hour when the config names none.
pub fn default_stopped_price(provider: ProviderKind) -> f64 {
    match provider {
        ProviderKind::Aws | ProviderKind::Exec => DEFAULT_STOPPED_PRICE_PER_HOUR,
        // A site's own disks bill nobody per machine; Slurm and pods do not stop.
        ProviderKind::Local | ProviderKind::Slurm | ProviderKind::Kubernetes => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::threshold;

    /// What a threshold `t` pays for a gap, against the best in hindsight, with buying at `b`.
    fn ratio(t: f64, b: f64, gap: f64) -> f64 {
        let paid = if gap <= t { gap } else { t + b };
        paid / gap.min(b)
    }

    /// The documented bound: whatever the prediction and the gap, at most 3× the hindsight
    /// optimum (trust 1/2), and at most 1.5× when the prediction falls on the right side of B.
    #[test]
    fn rent_or_buy_with_a_prediction_is_at_most_three_times_the_hindsight_best() {
        for b in [60.0, 120.0, 6818.0] {
            for predicted in [0.0, b * 0.5, b, b * 3.0, f64::INFINITY] {
                let (t, early) = threshold(b, predicted);
                assert_eq!(early, predicted >= b);
                for k in 1..=2000 {
                    let gap = b * 5.0 * f64::from(k) / 2000.0;
                    let r = ratio(t as f64, b, gap);
                    assert!(r <= 3.0 + 2.0 / b, "b {b} predicted {predicted} gap {gap}: {r}");
                    // The prediction was right: the real gap on the same side of B.
                    if (gap >= b) == early {
                        assert!(r <= 1.5 + 2.0 / b, "b {b} predicted {predicted} gap {gap}: {r}");
                    }
                }
            }
        }
    }
}
