//! Property-based fuzzing of everything a KV receiver and a worker accept from the network:
//! sequences of arbitrary transfer operations (headers with any geometry, block list and
//! token count; frames with any layer, block range, length and checksum; commits; aborts;
//! raw bytes decoded as pd.v1 sender messages) against a real registry over a real block
//! pool, and arbitrary bytes decoded as the pd.v1 requests workers take. Nothing panics, a
//! frame is accepted only when it fits its reservation exactly, and once the transfer is
//! over every block is back in the pool. `PROPTEST_CASES` sets the number of cases.

mod common;

use std::time::Duration;

use common::{geometry, Receiver};
use pd_engine::WireDType;
use pd_kv_transfer::convert::{sampling_from_pb, Target};
use pd_kv_transfer::kv_commit;
use pd_kv_transfer::{Frame, TransferHeader};
use pd_proto::v1 as pb;
use proptest::prelude::*;
use prost::Message;

const LEASE: Duration = Duration::from_secs(30);
const TOKENS: u32 = 40; // 3 blocks of 16

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256);
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

/// One thing a sender (or garbage on the wire) can do.
#[derive(Debug, Clone)]
enum Op {
    /// The header, with some fields replaced.
    Open {
        id: Option<String>,
        blocks: Option<Vec<u32>>,
        tokens: Option<u32>,
        layers: Option<u32>,
        size: Option<u32>,
    },
    Frame {
        layer: u32,
        first: u32,
        count: u32,
        len_delta: i32,
        bad_checksum: bool,
    },
    Commit {
        tokens: u32,
    },
    Abort,
    Raw(Vec<u8>),
}

fn small() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..6, Just(u32::MAX), any::<u32>()]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (
            prop::option::of(prop_oneof![Just("t".to_string()), ".{0,4}"]),
            prop::option::of(prop::collection::vec(small(), 0..5)),
            prop::option::of(prop_oneof![Just(TOKENS), small()]),
            prop::option::of(small()),
            prop::option::of(prop_oneof![Just(16u32), small()]),
        )
            .prop_map(|(id, blocks, tokens, layers, size)| Op::Open { id, blocks, tokens, layers, size }),
        4 => (0u32..3, 0u32..4, 0u32..4, prop_oneof![3 => Just(0i32), 1 => -8i32..8], prop::bool::weighted(0.1))
            .prop_map(|(layer, first, count, len_delta, bad_checksum)| Op::Frame {
                layer,
                first,
                count,
                len_delta,
                bad_checksum
            }),
        1 => prop_oneof![Just(TOKENS), small()].prop_map(|tokens| Op::Commit { tokens }),
        1 => Just(Op::Abort),
        1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Op::Raw),
    ]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_transfer_operations_never_panic_and_never_leak_blocks(
        opened in prop::bool::weighted(0.8),
        ops in prop::collection::vec(op(), 1..20),
    ) {
        let r = Receiver::new(geometry(WireDType::F16, 2), 8);
        let (header, mut outcome) = r.reserve("t", TOKENS, LEASE);
        // Every sender the registry accepted, oldest first: frames and commits come from the
        // newest, aborts from the oldest (superseded once a second header was accepted).
        let mut senders = Vec::new();
        if opened {
            // Mostly a well-opened transfer, so frames and commits reach the deeper checks.
            senders.push(r.registry.open(&header).expect("the true header opens"));
        }
        let mut committed = None;
        for op in ops {
            match op {
                Op::Open { id, blocks, tokens, layers, size } => {
                    let mut h = header.clone();
                    h.transfer_id = id.unwrap_or(h.transfer_id);
                    h.block_ids = blocks.unwrap_or(h.block_ids);
                    h.num_tokens = tokens.unwrap_or(h.num_tokens);
                    h.geometry.num_layers = layers.unwrap_or(h.geometry.num_layers);
                    h.geometry.block_size = size.unwrap_or(h.geometry.block_size);
                    senders.extend(r.registry.open(&h));
                }
                Op::Frame { layer, first, count, len_delta, bad_checksum } => {
                    let g = header.geometry;
                    let len = (g.frame_bytes(count as usize) as i64 + len_delta as i64).clamp(0, 1 << 20) as usize;
                    let mut frame = Frame::new(layer, first, count, common::payload(7, len));
                    if bad_checksum {
                        frame.checksum ^= 1;
                    }
                    let Some(&sender) = senders.last() else { continue };
                    if r.registry.apply_frame("t", sender, &frame).is_ok() {
                        let fits = layer < g.num_layers
                            && count > 0
                            && (first + count) as usize <= header.block_ids.len()
                            && len_delta == 0
                            && !bad_checksum;
                        prop_assert!(fits, "accepted a frame that does not fit: {frame:?}");
                    }
                }
                Op::Commit { tokens } => {
                    if let Some(&sender) = senders.last() {
                        let _ = r.registry.commit("t", sender, kv_commit(1, tokens));
                    }
                }
                Op::Abort => {
                    if let (Some(&oldest), Some(&newest)) = (senders.first(), senders.last()) {
                        let aborted = r.registry.sender_abort("t", oldest, "fuzz");
                        if oldest != newest {
                            prop_assert!(aborted.is_err(), "a superseded sender ended the transfer");
                        }
                    }
                }
                Op::Raw(bytes) => {
                    if let Ok(m) = pb::KvSenderMessage::decode(bytes.as_slice()) {
                        use pb::kv_sender_message::Message as M;
                        match m.message {
                            Some(M::Header(h)) => {
                                if let Ok(h) = TransferHeader::from_pb(h) {
                                    senders.extend(r.registry.open(&h));
                                }
                            }
                            Some(M::Frame(f)) => {
                                if let Some(&sender) = senders.last() {
                                    let _ = r.registry.apply_frame("t", sender, &Frame::from_pb(f));
                                }
                            }
                            Some(M::Commit(c)) => {
                                if let Some(&sender) = senders.last() {
                                    let _ = r.registry.commit("t", sender, kv_commit(c.first_token, c.prompt_tokens));
                                }
                            }
                            Some(M::Abort(a)) => {
                                let _ = r.registry.abort("t", &a.reason);
                            }
                            None => {}
                        }
                    }
                }
            }
            if let Ok(Ok(c)) = outcome.try_recv() {
                prop_assert_eq!(c.num_tokens, TOKENS, "a commit carries the reserved token count");
                committed = Some(c);
            }
        }
        // The sender is gone: whatever is still open is aborted; a committed sequence ends.
        r.registry.abort_all("fuzz run over");
        drop(committed);
        drop(outcome);
        prop_assert!(r.registry.is_empty());
        prop_assert!(r.all_free(), "blocks leaked: {} of {} free", r.blocks.free_blocks(), r.blocks.total_blocks());
    }

    #[test]
    fn arbitrary_bytes_as_worker_requests_are_refused_cleanly(bytes in prop::collection::vec(any::<u8>(), 0..128)) {
        if let Ok(req) = pb::DecodeRequest::decode(bytes.as_slice()) {
            if let Ok(p) = sampling_from_pb(req.sampling.as_ref(), req.output_offset) {
                prop_assert!(p.validate().is_ok() && p.max_tokens >= 1);
            }
        }
        if let Ok(req) = pb::PrefillRequest::decode(bytes.as_slice()) {
            let _ = sampling_from_pb(req.sampling.as_ref(), req.output_offset);
            if let Some(t) = req.target.as_ref() {
                if let Ok(target) = Target::from_pb(t) {
                    prop_assert!(!target.transfer_id.is_empty() && !target.kv_endpoint.is_empty());
                    let bs = target.geometry.block_size;
                    prop_assert!(target.cached_tokens == 0 || (bs > 0 && target.cached_tokens % bs == 0));
                }
            }
        }
        if let Ok(req) = pb::LoadRequest::decode(bytes.as_slice()) {
            let blocks = pd_engine::BlockManager::with_prefix_cache(4, 2, 1);
            let _ = pd_kv_transfer::convert::cache_events(&blocks, &req);
        }
    }
}
