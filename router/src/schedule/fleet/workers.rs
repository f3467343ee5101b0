//! One worker as the router sees it: what it reported at the last refresh, corrected by what
//! this router booked there since. Its own accounting changes only through its booking
//! methods; `Fleet` calls them and then moves the worker in its orderings (`fleet.rs`), so
//! these fields are visible to the fleet module and nothing outside it.

use std::time::Duration;

use pd_proto::v1 as pb;

use super::super::policy;
use super::super::prefixes::PrefixIndex;

/// A decode worker takes new streams while its step time is under this fraction of the
/// tightest ITL SLO among its streams.
pub const ITL_HEADROOM: f64 = 0.75;

/// A decode worker as last seen.
#[derive(Debug, Clone)]
pub struct DecodeState {
    pub addr: String,
    pub load: pb::DecodeLoad,
    /// Blocks of grants whose reservation the worker has not confirmed yet.
    pub(super) pending_blocks: u32,
    /// Requests this router has on the worker (granted and not finished).
    pub(super) ours: u32,
    /// `ours` when `load` was taken: fewer now means streams ended since.
    pub(super) ours_at_load: u32,
    /// The ITL SLO of each of them (the tightest one bounds the step time).
    pub(super) itl_slos: Vec<Duration>,
    /// Blocks of those requests (prompt and output each, shared prefixes counted per
    /// request: every stream reads its whole context each step).
    pub(super) active_blocks: u32,
    pub prefixes: PrefixIndex,
    /// Its key in `Fleet`'s decode ordering, as last filed.
    pub(super) filed: Option<(u32, u32)>,
}

impl DecodeState {
    pub fn new(addr: String, load: pb::DecodeLoad) -> Self {
        let prefixes = PrefixIndex::default();
        DecodeState {
            addr,
            load,
            pending_blocks: 0,
            ours: 0,
            ours_at_load: 0,
            itl_slos: Vec::new(),
            active_blocks: 0,
            prefixes,
            filed: None,
        }
    }

    /// A request of `blocks` (ITL SLO `itl`) granted here: its blocks count as taken until
    /// the worker confirms its reservation (`opened`).
    pub(super) fn book(&mut self, blocks: u32, itl: Duration) {
        self.pending_blocks += blocks;
        self.ours += 1;
        self.itl_slos.push(itl);
        self.active_blocks += blocks;
    }

    /// The worker reserved a booked request's blocks: its own free-block count includes them.
    pub(super) fn opened(&mut self, blocks: u32) {
        self.pending_blocks = self.pending_blocks.saturating_sub(blocks);
    }

    /// A booked request ended (`opened`: its reservation had been confirmed).
    pub(super) fn unbook(&mut self, blocks: u32, itl: Duration, opened: bool) {
        if !opened {
            self.opened(blocks);
        }
        self.ours = self.ours.saturating_sub(1);
        self.active_blocks = self.active_blocks.saturating_sub(blocks);
        if let Some(i) = self.itl_slos.iter().position(|x| *x == itl) {
            self.itl_slos.swap_remove(i);
        }
    }

    /// Requests this router has on the worker.
    pub fn ours(&self) -> u32 {
        self.ours
    }

    /// Load in blocks: this router's active requests', or what the worker uses if more.
    pub fn load_blocks(&self) -> u32 {
        let used = self.load.total_blocks.saturating_sub(self.free_blocks());
        self.active_blocks.max(used)
    }

    pub fn free_blocks(&self) -> u32 {
        self.load.free_blocks.saturating_sub(self.pending_blocks)
    }

    /// Blocks a sequence of `tokens` tokens needs.
    pub fn blocks_for(&self, tokens: usize) -> u32 {
        let size = self.load.block_size.max(1) as usize;
        tokens.div_ceil(size) as u32
    }

    pub fn free_fraction(&self) -> f64 {
        f64::from(self.free_blocks()) / f64::from(self.load.total_blocks.max(1))
    }

    /// Sequences on the worker: as last seen, less this router's that ended since, or this
    /// router's own if more.
    pub(super) fn busy(&self) -> u32 {
        let seen = self.load.running_sequences + self.load.waiting_transfers;
        seen.saturating_sub(self.ours_at_load.saturating_sub(self.ours)).max(self.ours)
    }

    /// The step time once the streams granted since the last refresh run too, and without
    /// this router's streams that ended since: each row added or gone costs about half a
    /// row's share of the step (batched rows share the weight reads); no row left, no step.
    /// (Without the ended ones, a client sending its next request as the last one ended was
    /// refused for the step time of a batch that no longer ran.)
    pub fn predicted_step_ms(&self) -> f64 {
        let rows = (self.load.running_sequences + self.load.waiting_transfers).max(1);
        let ended = self.ours_at_load.saturating_sub(self.ours);
        let now = rows.max(self.ours).saturating_sub(ended);
        if now == 0 {
            return 0.0;
        }
        let change = f64::from(now) - f64::from(rows);
        self.load.step_ms * (1.0 + change / (2.0 * f64::from(rows)))
    }

    /// True when a sequence needing `blocks` of a class with ITL SLO `itl` fits now: free
    /// blocks, a batch slot, and a step time under `ITL_HEADROOM` of the tightest ITL SLO of
    /// the streams there (this one included), so a new stream does not push them past it.
    pub fn has_room(&self, blocks: u32, itl: Duration) -> bool {
        let max_batch = if self.load.max_batch == 0 { u32::MAX } else { self.load.max_batch };
        let tightest = self.itl_slos.iter().copied().chain([itl]).min().unwrap_or(itl);
        let step_ok = self.predicted_step_ms() <= ITL_HEADROOM * tightest.as_secs_f64() * 1e3;
        self.free_blocks() >= blocks && self.busy() < max_batch && step_ok
    }
}

/// A prefill worker as last seen.
#[derive(Debug, Clone)]
pub struct PrefillState {
    pub addr: String,
    pub load: pb::PrefillLoad,
    /// This router's prompts on the worker: (request sequence number, tokens to compute).
    pub(super) in_flight: Vec<(u64, usize)>,
    pub prefixes: PrefixIndex,
    /// Its estimated wait for a new short prompt (`wait`) and rate, as last filed in
    /// `Fleet`'s prefill ordering.
    pub(super) filed: Option<(Duration, f64)>,
}

impl PrefillState {
    pub fn new(addr: String, load: pb::PrefillLoad) -> Self {
        PrefillState { addr, load, in_flight: Vec::new(), prefixes: PrefixIndex::default(), filed: None }
    }

    /// Request `seq`'s prompt, `tokens` of it to compute, sent here.
    pub(super) fn book(&mut self, seq: u64, tokens: usize) {
        self.in_flight.push((seq, tokens));
    }

    /// Request `seq`'s prompt is prefilled (or failed).
    pub(super) fn unbook(&mut self, seq: u64) {
        self.in_flight.retain(|(s, _)| *s != seq);
    }

    /// Prompts the worker runs together in one step.
    pub fn slots(&self) -> usize {
        self.load.max_partial_prefills.max(1) as usize
    }

    pub fn busy(&self) -> usize {
        self.in_flight.len().max((self.load.running_prefills + self.load.queued_prefills) as usize)
    }

    /// Free slots for a request of a class that is not the top priority keep one slot free
    /// for the top one (batch work never fills a worker).
    pub fn has_room(&self, top_priority: bool) -> bool {
        let slots = if top_priority { self.slots() } else { self.slots().saturating_sub(1).max(1) };
        self.busy() < slots
    }

    /// Measured tokens per second, or `prior` before the worker measured any.
    pub fn rate(&self, prior: f64) -> f64 {
        if self.load.prefill_tokens_per_s > 0.0 {
            self.load.prefill_tokens_per_s
        } else {
            prior
        }
    }

    /// Tokens still to prefill of each prompt in flight: ours, scaled down to what the worker
    /// reports not yet computed (they are partly done), plus what other routers sent.
    pub fn in_flight_tokens(&self) -> impl Iterator<Item = usize> + '_ {
        let ours: usize = self.in_flight.iter().map(|(_, t)| t).sum();
        let reported = self.load.waiting_prefill_tokens as usize;
        // 0 reported while we have prompts there: the refresh predates them.
        let scale = (reported > 0 && reported < ours).then(|| reported as f64 / ours as f64);
        let others = reported.checked_sub(ours).filter(|&r| r > 0);
        self.in_flight.iter().map(move |(_, t)| scale.map_or(*t, |s| (*t as f64 * s).ceil() as usize)).chain(others)
    }

    /// The estimated wait for a new short prompt: its prompts in flight, each up to
    /// `step_budget` tokens (one step's worth: longer prompts run beside it), at its rate.
    pub fn wait(&self, prior: f64, step_budget: usize) -> Duration {
        let ahead = policy::tokens_ahead::<()>(
            &[],
            0,
            |cap| self.in_flight_tokens().map(|t| t.min(cap) as u64).sum(),
            step_budget,
        );
        policy::estimated_wait(ahead, 0, self.rate(prior))
    }

    /// True when it has prompts in flight (ours, or reported by the worker).
    pub fn has_in_flight(&self) -> bool {
        !self.in_flight.is_empty() || self.load.waiting_prefill_tokens > 0
    }
}
