//! The receiving side's state: reservations of destination blocks under a lease, and the
//! checks every frame must pass before it is written.
//!
//! Invariants:
//! - A reservation owns its `BlockAllocation` until it is committed (handed to the decoder
//!   through the reservation's outcome channel) or fails; failing drops it, which frees the
//!   blocks. Failed and committed transfers leave the registry, so a late frame is refused as
//!   unknown and can never land in blocks that were given to another sequence.
//! - Each reservation has its own lock, held while its frame is written, so a transfer cannot
//!   be freed in the middle of a write.
//! - Frames may arrive in any order; each (layer, block) must arrive exactly once. A duplicate
//!   is refused (and fails the transfer): on one ordered stream it can only come from a
//!   confused sender, and silently accepting it could hide data from two senders mixed.
//! - If a sender's stream ends without commit or abort, the reservation returns to waiting
//!   (what arrived is forgotten) so a retry from another sender can fill it while the lease
//!   holds; when the lease ends it fails and frees the blocks.
//! - The newest sender wins. A header for a transfer that another stream holds open takes
//!   it over (what arrived is forgotten): the router retries on another prefill worker only
//!   after it gave up on the first, and this side may not have seen the first one's stream
//!   end yet (a killed process's connection closes when the kernel says so). Every later
//!   message of the older stream is refused as `superseded`, which fails that stream only:
//!   two senders' data never mix, and a stale sender cannot end the transfer.
//!
//! Lock order: a reservation's lock may be held while taking the registry map's lock, never
//! the other way round.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pd_engine::{BlockAllocation, WireDType};
use pd_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::error::TransferError;
use crate::wire::{Frame, FrameView, KvGeometry, TransferHeader};

/// Where received KV is written: the decode worker's KV cache, or memory in tests and benches.
pub trait KvSink: Send + Sync + 'static {
    /// Stores a frame payload (K then V of `block_ids`, in `dtype`) into `layer`.
    fn write_blocks(&self, layer: u32, block_ids: &[u32], dtype: WireDType, data: &[u8]) -> Result<(), String>;
}

impl KvSink for pd_engine::KvCache {
    fn write_blocks(&self, layer: u32, block_ids: &[u32], dtype: WireDType, data: &[u8]) -> Result<(), String> {
        pd_engine::kv::export::write_blocks(self, layer as usize, block_ids, dtype, data).map_err(|e| e.to_string())
    }
}

/// What the decode side reserves for one incoming transfer.
#[derive(Debug)]
pub struct Reservation {
    pub transfer_id: String,
    pub geometry: KvGeometry,
    /// Destination blocks, in token order; freed if the transfer fails.
    pub blocks: BlockAllocation,
    pub num_tokens: u32,
    pub lease: Duration,
}

/// A complete transfer, handed to the decoder.
#[derive(Debug)]
pub struct CommittedKv {
    pub transfer_id: String,
    pub blocks: BlockAllocation,
    pub num_tokens: u32,
    pub first_token: u32,
    /// The first token's log probabilities, when the request asked for them.
    pub first_logprobs: Option<pb::TokenLogprobs>,
    pub bytes: u64,
    pub frames: u32,
    /// W3C trace context the sender put in the header.
    pub trace_context: HashMap<String, String>,
    /// From the header's acceptance to the commit.
    pub receive_time: Duration,
}

/// How a reservation ended.
pub type Outcome = Result<CommittedKv, TransferError>;

/// The stream whose header a reservation accepted: `open` hands it out, and that stream's
/// frames, commit, abort and end name it, so a stream that was taken over cannot touch the
/// transfer any more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SenderId(u64);

#[derive(Debug)]
struct Entry {
    geometry: KvGeometry,
    block_ids: Vec<u32>,
    /// `None` once the entry has ended (blocks freed or handed over).
    blocks: Option<BlockAllocation>,
    num_tokens: u32,
    deadline: Instant,
    /// The sender whose header was accepted and whose stream is live.
    sender: Option<SenderId>,
    opened_at: Option<Instant>,
    /// received[layer * blocks + block]
    received: Vec<bool>,
    missing: usize,
    bytes: u64,
    frames: u32,
    trace_context: HashMap<String, String>,
    outcome: Option<oneshot::Sender<Outcome>>,
}

impl Entry {
    fn reset(&mut self) {
        self.sender = None;
        self.opened_at = None;
        self.received.iter_mut().for_each(|r| *r = false);
        self.missing = self.received.len();
        self.bytes = 0;
        self.frames = 0;
    }
}

/// Reservations of one receiving process.
pub struct KvRegistry {
    entries: Mutex<HashMap<String, Arc<Mutex<Entry>>>>,
    sink: Arc<dyn KvSink>,
    next_sender: AtomicU64,
}

impl std::fmt::Debug for KvRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KvRegistry({} reservations)", self.len())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // State is updated field by field with no invariant spanning a panic point.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl KvRegistry {
    pub fn new(sink: Arc<dyn KvSink>) -> Arc<Self> {
        Arc::new(KvRegistry { entries: Mutex::new(HashMap::new()), sink, next_sender: AtomicU64::new(0) })
    }

    /// Reservations not yet committed or failed.
    pub fn len(&self) -> usize {
        lock(&self.entries).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Registers a reservation; the receiver yields its outcome.
    pub fn reserve(&self, r: Reservation) -> Result<oneshot::Receiver<Outcome>, TransferError> {
        let blocks_needed = (r.num_tokens as usize).div_ceil(r.geometry.block_size.max(1) as usize);
        if r.blocks.ids().len() < blocks_needed || r.geometry.block_size as usize != r.blocks.block_size() {
            return Err(TransferError::Protocol(format!(
                "reservation of {} blocks of {} tokens cannot hold {} tokens in blocks of {}",
                r.blocks.ids().len(),
                r.blocks.block_size(),
                r.num_tokens,
                r.geometry.block_size
            )));
        }
        let (tx, rx) = oneshot::channel();
        let slots = r.geometry.num_layers as usize * r.blocks.ids().len();
        let entry = Entry {
            geometry: r.geometry,
            block_ids: r.blocks.ids().to_vec(),
            blocks: Some(r.blocks),
            num_tokens: r.num_tokens,
            deadline: Instant::now() + r.lease,
            sender: None,
            opened_at: None,
            received: vec![false; slots],
            missing: slots,
            bytes: 0,
            frames: 0,
            trace_context: HashMap::new(),
            outcome: Some(tx),
        };
        let mut entries = lock(&self.entries);
        if entries.contains_key(&r.transfer_id) {
            return Err(TransferError::AlreadyReserved(r.transfer_id));
        }
        entries.insert(r.transfer_id, Arc::new(Mutex::new(entry)));
        Ok(rx)
    }

    fn get(&self, id: &str) -> Result<Arc<Mutex<Entry>>, TransferError> {
        lock(&self.entries).get(id).cloned().ok_or_else(|| TransferError::UnknownTransfer(id.to_string()))
    }

    /// Ends an entry with `err`: leaves the registry, frees the blocks, tells the waiter.
    fn fail_locked(&self, id: &str, entry: &mut Entry, err: TransferError) -> TransferError {
        lock(&self.entries).remove(id);
        entry.blocks = None;
        if let Some(tx) = entry.outcome.take() {
            let _ = tx.send(Err(err.clone())); // the waiter may be gone; the blocks are freed either way
        }
        err
    }

    /// Runs `f` on a live, unexpired entry; any error it returns fails the transfer. With
    /// `sender`, the entry must still be that sender's: a superseded stream is refused and the
    /// transfer goes on.
    fn with_entry<T>(
        &self,
        id: &str,
        sender: Option<SenderId>,
        f: impl FnOnce(&mut Entry) -> Result<T, TransferError>,
    ) -> Result<T, TransferError> {
        let arc = self.get(id)?;
        let mut entry = lock(&arc);
        self.with_entry_checks(id, sender, &mut entry, f)
    }

    /// Accepts a sender's header if it matches the reservation exactly; a stream that held the
    /// transfer open is superseded (see the module notes).
    pub fn open(&self, header: &TransferHeader) -> Result<SenderId, TransferError> {
        self.with_entry(&header.transfer_id, None, |e| {
            header.geometry.check_matches(&e.geometry)?;
            if header.block_ids != e.block_ids {
                return Err(TransferError::Incompatible(format!(
                    "header names blocks {:?}, the reservation holds {:?}",
                    header.block_ids, e.block_ids
                )));
            }
            if header.num_tokens != e.num_tokens {
                return Err(TransferError::Incompatible(format!(
                    "header has {} tokens, the reservation {}",
                    header.num_tokens, e.num_tokens
                )));
            }
            e.reset();
            let sender = SenderId(self.next_sender.fetch_add(1, Ordering::Relaxed));
            e.sender = Some(sender);
            e.opened_at = Some(Instant::now());
            e.trace_context = header.trace_context.clone();
            Ok(sender)
        })
    }

    /// Checks a frame against the reservation and writes it into the destination blocks.
    pub fn apply_frame(&self, id: &str, sender: SenderId, frame: &Frame) -> Result<(), TransferError> {
        self.apply_frame_view(id, sender, frame.view())
    }

    /// `apply_frame` for a frame whose data is borrowed from a receive buffer.
    pub fn apply_frame_view(&self, id: &str, sender: SenderId, frame: FrameView<'_>) -> Result<(), TransferError> {
        self.with_entry(id, Some(sender), |e| {
            let g = e.geometry;
            if frame.layer >= g.num_layers {
                return Err(TransferError::LayerOutOfRange { layer: frame.layer, layers: g.num_layers });
            }
            let first = frame.first_block as u64;
            let end = first + frame.block_count as u64;
            if frame.block_count == 0 || end > e.block_ids.len() as u64 {
                return Err(TransferError::BlockNotReserved { first, end, reserved: e.block_ids.len() });
            }
            let expected = g.frame_bytes(frame.block_count as usize);
            if frame.data.len() != expected {
                return Err(TransferError::ShapeMismatch { layer: frame.layer, got: frame.data.len(), expected });
            }
            if crc32fast::hash(frame.data) != frame.checksum {
                return Err(TransferError::ChecksumMismatch {
                    layer: frame.layer,
                    first: frame.first_block,
                    end: end as u32,
                });
            }
            let base = frame.layer as usize * e.block_ids.len();
            let range = base + first as usize..base + end as usize;
            if let Some(dup) = e.received[range.clone()].iter().position(|&r| r) {
                return Err(TransferError::DuplicateFrame {
                    layer: frame.layer,
                    block: frame.first_block + dup as u32,
                });
            }
            let ids = &e.block_ids[first as usize..end as usize];
            self.sink.write_blocks(frame.layer, ids, g.dtype, frame.data).map_err(TransferError::Sink)?;
            e.received[range].iter_mut().for_each(|r| *r = true);
            e.missing -= frame.block_count as usize;
            e.bytes += frame.data.len() as u64;
            e.frames += 1;
            Ok(())
        })
    }

    /// Completes a transfer whose every (layer, block) arrived; hands the blocks to the waiter.
    /// Returns (bytes, frames) received.
    pub fn commit(&self, id: &str, sender: SenderId, commit: pb::KvCommit) -> Result<(u64, u32), TransferError> {
        let pb::KvCommit { first_token, prompt_tokens, first_logprobs } = commit;
        let arc = self.get(id)?;
        let mut entry = lock(&arc);
        let checked = self.with_entry_checks(id, Some(sender), &mut entry, |e| {
            if e.missing > 0 {
                return Err(TransferError::Incomplete(format!(
                    "{} of {} (layer, block) pieces never arrived",
                    e.missing,
                    e.received.len()
                )));
            }
            if prompt_tokens != e.num_tokens {
                return Err(TransferError::Incomplete(format!(
                    "commit says {prompt_tokens} prompt tokens, the header {}",
                    e.num_tokens
                )));
            }
            Ok(())
        });
        checked?;
        lock(&self.entries).remove(id);
        let (bytes, frames) = (entry.bytes, entry.frames);
        let committed = CommittedKv {
            transfer_id: id.to_string(),
            blocks: entry.blocks.take().ok_or_else(|| TransferError::UnknownTransfer(id.to_string()))?,
            num_tokens: entry.num_tokens,
            first_token,
            first_logprobs,
            bytes,
            frames,
            trace_context: std::mem::take(&mut entry.trace_context),
            receive_time: entry.opened_at.map(|t| t.elapsed()).unwrap_or_default(),
        };
        if let Some(tx) = entry.outcome.take() {
            // If the waiter is gone, the blocks come back here and are freed on drop.
            let _ = tx.send(Ok(committed));
        }
        Ok((bytes, frames))
    }

    fn with_entry_checks<T>(
        &self,
        id: &str,
        sender: Option<SenderId>,
        entry: &mut Entry,
        f: impl FnOnce(&mut Entry) -> Result<T, TransferError>,
    ) -> Result<T, TransferError> {
        if entry.blocks.is_none() {
            return Err(TransferError::UnknownTransfer(id.to_string()));
        }
        if Instant::now() > entry.deadline {
            return Err(self.fail_locked(id, entry, TransferError::LeaseExpired(id.to_string())));
        }
        if let Some(sender) = sender {
            if entry.sender != Some(sender) {
                return Err(TransferError::Superseded(id.to_string()));
            }
        }
        f(entry).map_err(|e| self.fail_locked(id, entry, e))
    }

    /// Ends a transfer on the receiving side's own account (its client left, shutdown); frees
    /// the blocks.
    pub fn abort(&self, id: &str, reason: &str) -> Result<(), TransferError> {
        self.end(id, None, TransferError::Aborted(reason.to_string())).map(|_| ())
    }

    /// Ends a transfer at its sender's request; a superseded sender's abort is refused.
    pub fn sender_abort(&self, id: &str, sender: SenderId, reason: &str) -> Result<(), TransferError> {
        self.end(id, Some(sender), TransferError::Aborted(reason.to_string())).map(|_| ())
    }

    /// Fails a reservation with `err` (a header that could not even be decoded, a message out of
    /// order); with `sender`, only while that sender holds it. Returns the error to report.
    pub fn reject(&self, id: &str, sender: Option<SenderId>, err: TransferError) -> TransferError {
        match self.end(id, sender, err.clone()) {
            Ok(err) | Err(err @ TransferError::Superseded(_)) => err,
            Err(_) => err, // already ended: the caller's own error says more
        }
    }

    /// Fails the live entry `id` with `err` (returned), unless it has ended or, with `sender`,
    /// another sender holds it.
    fn end(&self, id: &str, sender: Option<SenderId>, err: TransferError) -> Result<TransferError, TransferError> {
        let arc = self.get(id)?;
        let mut entry = lock(&arc);
        if entry.blocks.is_none() {
            return Err(TransferError::UnknownTransfer(id.to_string()));
        }
        if let Some(sender) = sender {
            if entry.sender != Some(sender) {
                return Err(TransferError::Superseded(id.to_string()));
            }
        }
        Ok(self.fail_locked(id, &mut entry, err))
    }

    /// The sender's stream ended without commit or abort: forget what arrived and wait for a
    /// retry until the lease ends. Nothing happens if another sender took the transfer over.
    pub fn detach(&self, id: &str, sender: SenderId) {
        if let Ok(arc) = self.get(id) {
            let mut entry = lock(&arc);
            if entry.sender == Some(sender) {
                entry.reset();
            }
        }
    }

    /// Aborts every reservation (shutdown after the grace period); returns how many.
    pub fn abort_all(&self, reason: &str) -> usize {
        let ids: Vec<String> = lock(&self.entries).keys().cloned().collect();
        ids.iter().filter(|id| self.abort(id, reason).is_ok()).count()
    }

    /// Fails every reservation whose lease has ended; returns how many.
    pub fn expire_due(&self) -> usize {
        let now = Instant::now();
        let all: Vec<(String, Arc<Mutex<Entry>>)> =
            lock(&self.entries).iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut expired = 0;
        for (id, arc) in all {
            let mut entry = lock(&arc);
            if entry.blocks.is_some() && now > entry.deadline {
                self.fail_locked(&id, &mut entry, TransferError::LeaseExpired(id.clone()));
                expired += 1;
            }
        }
        expired
    }
}

/// Memory laid out like one KV cache (`[layer][block][K|V]`), for transport tests and benches
/// that move synthetic KV without a model.
#[derive(Debug)]
pub struct MemorySink {
    geometry: KvGeometry,
    num_blocks: usize,
    /// Per layer: `num_blocks` x (K block bytes + V block bytes).
    layers: Vec<Mutex<Vec<u8>>>,
}

impl MemorySink {
    pub fn new(geometry: KvGeometry, num_blocks: usize) -> Self {
        let per_layer = num_blocks * 2 * geometry.block_bytes();
        MemorySink {
            geometry,
            num_blocks,
            layers: (0..geometry.num_layers).map(|_| Mutex::new(vec![0u8; per_layer])).collect(),
        }
    }

    /// K then V of `block` in `layer`, as stored.
    pub fn block(&self, layer: u32, block: u32) -> Vec<u8> {
        let size = 2 * self.geometry.block_bytes();
        let data = lock(&self.layers[layer as usize]);
        data[block as usize * size..(block as usize + 1) * size].to_vec()
    }
}

impl KvSink for MemorySink {
    fn write_blocks(&self, layer: u32, block_ids: &[u32], dtype: WireDType, data: &[u8]) -> Result<(), String> {
        if dtype != self.geometry.dtype {
            return Err(format!("sink holds {:?}, frame is {dtype:?}", self.geometry.dtype));
        }
        let half = self.geometry.block_bytes();
        let n = block_ids.len();
        if data.len() != 2 * n * half {
            return Err(format!("{} bytes for {n} blocks", data.len()));
        }
        let layer_data = self.layers.get(layer as usize).ok_or_else(|| format!("no layer {layer}"))?;
        let mut store = lock(layer_data);
        for (i, &block) in block_ids.iter().enumerate() {
            if block as usize >= self.num_blocks {
                return Err(format!("block {block} is outside the sink's {} blocks", self.num_blocks));
            }
            let at = block as usize * 2 * half;
            store[at..at + half].copy_from_slice(&data[i * half..(i + 1) * half]);
            store[at + half..at + 2 * half].copy_from_slice(&data[(n + i) * half..(n + i + 1) * half]);
        }
        Ok(())
    }
}

/// K then V of `blocks` from a payload laid out like a frame, per block (for tests comparing
/// what was sent with what a sink holds).
pub fn split_frame_payload(geometry: &KvGeometry, blocks: usize, data: &[u8]) -> Vec<Vec<u8>> {
    let half = geometry.block_bytes();
    (0..blocks)
        .map(|i| {
            let mut out = data[i * half..(i + 1) * half].to_vec();
            out.extend_from_slice(&data[(blocks + i) * half..(blocks + i + 1) * half]);
            out
        })
        .collect()
}
