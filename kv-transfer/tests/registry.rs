//! Every receiver-side check, without a network: each bad frame or header is refused with a
//! reason, fails the transfer, tells the waiter and frees the blocks.

mod common;

use std::time::Duration;

use common::{frames, geometry, Receiver};
use pd_engine::WireDType;
use pd_kv_transfer::kv_commit;
use pd_kv_transfer::{Frame, SenderId, TransferError};

const LEASE: Duration = Duration::from_secs(30);

type Waiter = tokio::sync::oneshot::Receiver<pd_kv_transfer::Outcome>;

/// Reserves 40 tokens (3 blocks) over 2 layers, opens it, and returns what is needed.
fn opened() -> (Receiver, pd_kv_transfer::TransferHeader, Waiter, SenderId) {
    let r = Receiver::new(geometry(WireDType::F16, 2), 8);
    let (header, outcome) = r.reserve("t1", 40, LEASE);
    let sender = r.registry.open(&header).expect("open");
    (r, header, outcome, sender)
}

fn assert_failed(
    r: &Receiver,
    mut outcome: tokio::sync::oneshot::Receiver<pd_kv_transfer::Outcome>,
    err: &TransferError,
    kind: &str,
) {
    assert_eq!(err.kind(), kind, "{err}");
    assert!(r.all_free(), "blocks freed after {kind}");
    assert!(r.registry.is_empty());
    match outcome.try_recv() {
        Ok(Err(e)) => assert_eq!(e.kind(), kind),
        other => panic!("waiter should see the failure, got {other:?}"),
    }
}

#[test]
fn complete_transfer_commits_and_hands_over_the_blocks() {
    let (r, header, mut outcome, sender) = opened();
    let all = frames(&header, 1, 2);
    for f in all.iter().rev() {
        r.registry.apply_frame("t1", sender, f).expect("frame in any order");
    }
    let (bytes, count) = r.registry.commit("t1", sender, kv_commit(42, 40)).expect("commit");
    assert_eq!(count as usize, all.len());
    assert_eq!(bytes as usize, all.iter().map(|f| f.data.len()).sum::<usize>());
    common::assert_landed(&r, &header, &all);
    let committed = outcome.try_recv().expect("outcome").expect("committed");
    assert_eq!((committed.first_token, committed.num_tokens), (42, 40));
    assert_eq!(committed.blocks.ids(), header.block_ids.as_slice());
    assert_eq!(r.blocks.free_blocks(), 5, "blocks now belong to the decoder");
    drop(committed);
    assert!(r.all_free());
    let late = r.registry.apply_frame("t1", sender, &all[0]).expect_err("after commit");
    assert_eq!(late.kind(), "unknown_transfer");
}

#[test]
fn corrupted_checksum_is_refused() {
    let (r, header, outcome, sender) = opened();
    let mut f = frames(&header, 2, 3).remove(0);
    f.data[5] ^= 0xff;
    let err = r.registry.apply_frame("t1", sender, &f).expect_err("checksum");
    assert!(err.to_string().contains("checksum mismatch in layer 0 blocks 0..3"), "{err}");
    assert_failed(&r, outcome, &err, "checksum_mismatch");
}

#[test]
fn wrong_shape_is_refused() {
    let (r, header, outcome, sender) = opened();
    let mut f = frames(&header, 3, 3).remove(0);
    f.data.truncate(f.data.len() - 2);
    let f = Frame::new(f.layer, f.first_block, f.block_count, f.data);
    let err = r.registry.apply_frame("t1", sender, &f).expect_err("shape");
    assert_failed(&r, outcome, &err, "shape_mismatch");
}

#[test]
fn unknown_transfer_id_is_refused_and_touches_nothing() {
    let (r, header, _outcome, sender) = opened();
    let f = frames(&header, 4, 3).remove(0);
    let err = r.registry.apply_frame("nope", sender, &f).expect_err("unknown");
    assert_eq!(err.kind(), "unknown_transfer");
    let mut other = header.clone();
    other.transfer_id = "nope".into();
    assert_eq!(r.registry.open(&other).expect_err("unknown").kind(), "unknown_transfer");
    assert_eq!(r.registry.len(), 1, "the real reservation is untouched");
}

#[test]
fn expired_lease_is_refused_and_reaped() {
    let r = Receiver::new(geometry(WireDType::F32, 2), 8);
    let (header, outcome) = r.reserve("short", 40, Duration::from_millis(30));
    let sender = r.registry.open(&header).expect("open");
    std::thread::sleep(Duration::from_millis(60));
    let err = r.registry.apply_frame("short", sender, &frames(&header, 5, 3)[0]).expect_err("expired");
    assert_failed(&r, outcome, &err, "lease_expired");

    let (_header, outcome) = r.reserve("idle", 16, Duration::from_millis(20));
    assert!(!r.all_free());
    std::thread::sleep(Duration::from_millis(40));
    assert_eq!(r.registry.expire_due(), 1);
    assert_failed(&r, outcome, &TransferError::LeaseExpired("idle".into()), "lease_expired");
}

#[test]
fn blocks_outside_the_reservation_are_refused() {
    let (r, header, outcome, sender) = opened();
    let g = header.geometry;
    let f = Frame::new(0, 2, 2, vec![7u8; g.frame_bytes(2)]);
    let err = r.registry.apply_frame("t1", sender, &f).expect_err("blocks 2..4 of 3");
    assert!(err.to_string().contains("2..4"), "{err}");
    assert_failed(&r, outcome, &err, "block_not_reserved");
}

#[test]
fn layer_out_of_range_is_refused() {
    let (r, header, outcome, sender) = opened();
    let g = header.geometry;
    let err =
        r.registry.apply_frame("t1", sender, &Frame::new(2, 0, 1, vec![1u8; g.frame_bytes(1)])).expect_err("layer");
    assert_failed(&r, outcome, &err, "layer_out_of_range");
}

#[test]
fn duplicate_frame_is_refused() {
    let (r, header, outcome, sender) = opened();
    let all = frames(&header, 6, 1);
    r.registry.apply_frame("t1", sender, &all[1]).expect("first time");
    let err = r.registry.apply_frame("t1", sender, &all[1]).expect_err("second time");
    assert!(err.to_string().contains("block index 1"), "{err}");
    assert_failed(&r, outcome, &err, "duplicate_frame");
}

#[test]
fn incompatible_handshakes_are_refused_before_any_data() {
    type Change = fn(&mut pd_kv_transfer::TransferHeader);
    let changes: [(&str, Change); 5] = [
        ("fingerprint", |h| h.geometry.model_fingerprint ^= 1),
        ("dtype", |h| h.geometry.dtype = WireDType::F32),
        ("block_size", |h| h.geometry.block_size = 32),
        ("head_dim", |h| h.geometry.head_dim = 16),
        ("blocks", |h| h.block_ids.reverse()),
    ];
    for (what, change) in changes {
        let r = Receiver::new(geometry(WireDType::F16, 2), 8);
        let (mut header, outcome) = r.reserve("t", 40, LEASE);
        change(&mut header);
        let err = r.registry.open(&header).expect_err(what);
        assert_failed(&r, outcome, &err, "incompatible");
    }
}

#[test]
fn commit_before_every_piece_arrived_is_refused() {
    let (r, header, outcome, sender) = opened();
    let all = frames(&header, 7, 3);
    r.registry.apply_frame("t1", sender, &all[0]).expect("layer 0");
    let err = r.registry.commit("t1", sender, kv_commit(1, 40)).expect_err("layer 1 missing");
    assert!(err.to_string().contains("never arrived"), "{err}");
    assert_failed(&r, outcome, &err, "incomplete");
}

#[test]
fn a_detached_sender_can_be_replaced_while_the_lease_holds() {
    let (r, header, mut outcome, first) = opened();
    let all = frames(&header, 8, 3);
    r.registry.apply_frame("t1", first, &all[0]).expect("first sender, layer 0");
    r.registry.detach("t1", first);
    assert!(!r.all_free(), "blocks stay reserved for a retry");
    let second = r.registry.open(&header).expect("second sender");
    for f in &all {
        r.registry.apply_frame("t1", second, f).expect("retry sends everything again");
    }
    r.registry.commit("t1", second, kv_commit(3, 40)).expect("commit");
    assert!(outcome.try_recv().expect("outcome").is_ok());
}

/// The router retried on another prefill worker before this side saw the first one's stream
/// end: the newer header takes the transfer over, and nothing the older stream sends later
/// (frames, commit, abort, end, protocol errors) lands or ends the transfer.
#[test]
fn a_newer_sender_takes_over_a_stream_not_yet_seen_ending() {
    let (r, header, mut outcome, first) = opened();
    let (all, other) = (frames(&header, 9, 3), frames(&header, 10, 3));
    r.registry.apply_frame("t1", first, &other[0]).expect("first sender, layer 0");
    let second = r.registry.open(&header).expect("the retry's header takes over");
    for f in &all {
        r.registry.apply_frame("t1", second, f).expect("the retry sends everything, layer 0 included");
    }
    let stale = r.registry.apply_frame("t1", first, &other[1]).expect_err("the first sender's next frame");
    assert_eq!(stale.kind(), "superseded", "{stale}");
    assert_eq!(r.registry.commit("t1", first, kv_commit(3, 40)).expect_err("stale commit").kind(), "superseded");
    assert!(r.registry.sender_abort("t1", first, "gone").is_err(), "a stale abort is refused");
    let err = r.registry.reject("t1", Some(first), TransferError::Protocol("bad".into()));
    assert_eq!(err.kind(), "superseded", "a stale stream's protocol error fails only that stream");
    r.registry.detach("t1", first);
    r.registry.commit("t1", second, kv_commit(3, 40)).expect("commit");
    let committed = outcome.try_recv().expect("outcome").expect("committed");
    common::assert_landed(&r, &header, &all);
    drop(committed);
    assert!(r.all_free());
}
