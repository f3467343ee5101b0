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
//!
//! Lock order: a reservation's lock may be held while taking the registry map's lock, never
//! the other way round.

use std::collections::HashMap;
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

#[derive(Debug)]
struct Entry {
    geometry: KvGeometry,
    block_ids: Vec<u32>,
    /// `None` once the entry has ended (blocks freed or handed over).
    blocks: Option<BlockAllocation>,
    num_tokens: u32,
    deadline: Instant,
    /// A sender's header was accepted and its stream is live.
    open: bool,
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
        self.open = false;
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
        Arc::new(KvRegistry { entries: Mutex::new(HashMap::new()), sink })
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
            open: false,
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

    /// Runs `f` on a live, unexpired entry; any error it returns fails the transfer.
    fn with_entry<T>(
        &self,
        id: &str,
        f: impl FnOnce(&mut Entry) -> Result<T, TransferError>,
    ) -> Result<T, TransferError> {
        let arc = self.get(id)?;
        let mut entry = lock(&arc);
        if entry.blocks.is_none() {
            return Err(TransferError::UnknownTransfer(id.to_string()));
        }
        if Instant::now() > entry.deadline {
            return Err(self.fail_locked(id, &mut entry, TransferError::LeaseExpired(id.to_string())));
        }
        match f(&mut entry) {
            Ok(v) => Ok(v),
            Err(e) => Err(self.fail_locked(id, &mut entry, e)),
        }
    }

    /// Accepts a sender's header if it matches the reservation exactly.
    pub fn open(&self, header: &TransferHeader) -> Result<(), TransferError> {
        self.with_entry(&header.transfer_id, |e| {
            if e.open {
                return Err(TransferError::Protocol("a sender is already streaming this transfer".into()));
            }
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
            e.open = true;
            e.opened_at = Some(Instant::now());
            e.trace_context = header.trace_context.clone();
            Ok(())
        })
    }

    /// Checks a frame against the reservation and writes it into the destination blocks.
    pub fn apply_frame(&self, id: &str, frame: &Frame) -> Result<(), TransferError> {
        self.apply_frame_view(id, frame.view())
    }

    /// `apply_frame` for a frame whose data is borrowed from a receive buffer.
    pub fn apply_frame_view(&self, id: &str, frame: FrameView<'_>) -> Result<(), TransferError> {
        self.with_entry(id, |e| {
            if !e.open {
                return Err(TransferError::Protocol("frame before the header was accepted".into()));
            }
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
    pub fn commit(&self, id: &str, commit: pb::KvCommit) -> Result<(u64, u32), TransferError> {
        let pb::KvCommit { first_token, prompt_tokens, first_logprobs } = commit;
        let arc = self.get(id)?;
        let mut entry = lock(&arc);
        let checked = self.with_entry_checks(id, &mut entry, |e| {
            if !e.open {
                return Err(TransferError::Protocol("commit before the header was accepted".into()));
            }
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

    fn with_entry_checks(
        &self,
        id: &str,
        entry: &mut Entry,
        f: impl FnOnce(&mut Entry) -> Result<(), TransferError>,
    ) -> Result<(), TransferError> {
        if entry.blocks.is_none() {
            return Err(TransferError::UnknownTransfer(id.to_string()));
        }
        if Instant::now() > entry.deadline {
            return Err(self.fail_locked(id, entry, TransferError::LeaseExpired(id.to_string())));
        }
        f(entry).map_err(|e| self.fail_locked(id, entry, e))
    }

    /// Ends a transfer on the sender's (or anyone's) request; frees the blocks.
    pub fn abort(&self, id: &str, reason: &str) -> Result<(), TransferError> {
        let arc = self.get(id)?;
        let mut entry = lock(&arc);
        if entry.blocks.is_none() {
            return Err(TransferError::UnknownTransfer(id.to_string()));
        }
        self.fail_locked(id, &mut entry, TransferError::Aborted(reason.to_string()));
        Ok(())
    }

    /// Fails a reservation with `err` (e.g. a header that could not even be decoded).
    pub fn reject(&self, id: &str, err: TransferError) -> TransferError {
        match self.get(id) {
            Ok(arc) => {
                let mut entry = lock(&arc);
                if entry.blocks.is_none() {
                    return err;
                }
                self.fail_locked(id, &mut entry, err)
            }
            Err(_) => err,
        }
    }

    /// The sender's stream ended without commit or abort: forget what arrived and wait for a
    /// retry until the lease ends.
    pub fn detach(&self, id: &str) {
        if let Ok(arc) = self.get(id) {
            lock(&arc).reset();
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
