use super::*;

#[test]
fn allocation_returns_blocks_on_drop() {
    let manager = BlockManager::new(8, 16);
    let a = manager.allocate(3).expect("3 of 8");
    let b = manager.allocate(5).expect("5 of 5");
    assert_eq!(manager.free_blocks(), 0);
    assert!((manager.usage_ratio() - 1.0).abs() < 1e-12);
    let mut all: Vec<_> = a.ids().iter().chain(b.ids()).copied().collect();
    all.sort_unstable();
    assert_eq!(all, (0..8).collect::<Vec<_>>(), "ids are distinct and cover the pool");
    drop(a);
    assert_eq!(manager.free_blocks(), 3);
    drop(b);
    assert_eq!(manager.free_blocks(), 8);
    assert_eq!(manager.usage_ratio(), 0.0);
}

#[test]
fn absorb_moves_blocks_and_refuses_other_pools() {
    let manager = BlockManager::new(6, 4);
    let mut a = manager.allocate(2).expect("2");
    let b = manager.allocate(3).expect("3");
    let b_ids = b.ids().to_vec();
    a.absorb(b).expect("same pool");
    assert_eq!(&a.ids()[2..], b_ids.as_slice());
    assert_eq!(manager.free_blocks(), 1);
    let other = BlockManager::new(2, 4);
    assert!(a.absorb(other.allocate(1).expect("1")).is_err());
    assert_eq!(other.free_blocks(), 2, "refused blocks go back to their pool");
    drop(a);
    assert_eq!(manager.free_blocks(), 6);
}

#[test]
fn out_of_blocks_is_an_error_and_takes_nothing() {
    let manager = BlockManager::new(4, 16);
    let _held = manager.allocate(3).expect("3 of 4");
    let err = manager.allocate(2).expect_err("only 1 free");
    assert!(matches!(err, EngineError::OutOfBlocks { needed: 2, free: 1, total: 4 }));
    assert!(err.to_string().contains("out of KV blocks"));
    assert_eq!(manager.free_blocks(), 1);
}

#[test]
fn ensure_tokens_grows_all_or_nothing_and_maps_slots() {
    let manager = BlockManager::new(3, 4);
    let mut alloc = manager.empty_allocation();
    alloc.ensure_tokens(5).expect("2 blocks");
    assert_eq!(alloc.ids().len(), 2);
    assert_eq!(alloc.capacity_tokens(), 8);
    let first = alloc.ids()[0] as usize;
    let second = alloc.ids()[1] as usize;
    assert_eq!(alloc.slot(0), Some(first * 4));
    assert_eq!(alloc.slot(5), Some(second * 4 + 1));
    assert_eq!(alloc.slot(8), None);
    assert!(alloc.ensure_tokens(13).is_err(), "needs 4 blocks, pool has 3");
    assert_eq!(alloc.ids().len(), 2, "failed growth keeps what it had");
    assert_eq!(manager.free_blocks(), 1);
    drop(alloc);
    assert_eq!(manager.free_blocks(), 3);
}

fn cached_pool(blocks: usize, bs: usize) -> BlockManager {
    BlockManager::with_prefix_cache(blocks, bs, prefix::hash_seed(1, bs))
}

#[test]
fn a_registered_prefix_is_shared_and_counted() {
    let manager = cached_pool(8, 4);
    let prompt: Vec<u32> = (0..10).collect();
    let (mut first, cached) = manager.allocate_prefix(&prompt, 12).expect("3 blocks");
    assert_eq!((cached, first.ids().len()), (0, 3));
    manager.register(&mut first, &prompt);
    assert_eq!(manager.cached_blocks(), 2, "two full blocks of 10 tokens");
    // A second prompt sharing 9 tokens (2 full blocks, the second ending mid-way) reuses one.
    let other: Vec<u32> = (0..6).chain([99, 98, 97]).collect();
    assert_eq!(manager.cached_prefix_tokens(&other), 4);
    let (second, cached) = manager.allocate_prefix(&other, 9).expect("fits");
    assert_eq!(cached, 4);
    assert_eq!(second.ids()[0], first.ids()[0], "the first block is shared");
    assert_ne!(second.ids()[1], first.ids()[1]);
    assert_eq!(manager.held_blocks(), 3 + 2, "a shared block counts once");
    assert_eq!(manager.prefix_stats(), (19, 4));
    drop(first);
    drop(second);
    assert_eq!(manager.free_blocks(), 8, "cached blocks nobody holds can be allocated");
    assert_eq!(manager.cached_blocks(), 2, "and stay cached until then");
}

#[test]
fn the_last_prompt_token_is_always_computed() {
    let manager = cached_pool(8, 4);
    let prompt: Vec<u32> = (0..8).collect();
    let (mut a, _) = manager.allocate_prefix(&prompt, 8).expect("2");
    manager.register(&mut a, &prompt);
    drop(a);
    let (_b, cached) = manager.allocate_prefix(&prompt, 8).expect("2");
    assert_eq!(cached, 4, "an exact repeat reuses all but the block of its last token");
}

#[test]
fn eviction_takes_least_recently_released_tails_first_and_never_held_blocks() {
    let manager = cached_pool(4, 2);
    let p: Vec<u32> = vec![1, 2, 3, 4, 5];
    let (mut a, _) = manager.allocate_prefix(&p, 6).expect("3 blocks");
    manager.register(&mut a, &p);
    let head = a.ids()[0];
    drop(a);
    assert_eq!(manager.cached_blocks(), 2);
    // Three blocks: the two free ones, then the tail of the released prefix.
    let b = manager.allocate(3).expect("3");
    assert_eq!(manager.cached_blocks(), 1, "the prefix's second block went first");
    assert_eq!(manager.cached_prefix_tokens(&p), 2, "its head is still there");
    drop(b);
    let (held, cached) = manager.allocate_prefix(&[1, 2, 9], 3).expect("reuses the head");
    assert_eq!((held.ids()[0], cached), (head, 2));
    let err = manager.allocate(3).expect_err("the held head is not evictable");
    assert!(matches!(err, EngineError::OutOfBlocks { needed: 3, free: 2, total: 4 }));
    assert_eq!(manager.cached_prefix_tokens(&p), 2, "a failed allocation evicts nothing");
    drop(held);
    assert_eq!(manager.free_blocks(), 4);
    let EventsSince::Events(events) = manager.events_since(0, 100) else { panic!("no gap") };
    let kinds: Vec<_> = events.iter().map(|e| e.kind).collect();
    assert_eq!(kinds, vec![BlockEventKind::Stored, BlockEventKind::Stored, BlockEventKind::Removed]);
    assert_eq!(manager.last_event(), 3);
}

#[test]
fn duplicates_stay_private_and_a_disabled_cache_finds_nothing() {
    let manager = cached_pool(6, 2);
    let p = vec![7, 8, 9];
    let (mut a, _) = manager.allocate_prefix(&p, 3).expect("a");
    let (mut b, _) = manager.allocate_prefix(&p, 3).expect("b: computed at the same time");
    manager.register(&mut a, &p);
    manager.register(&mut b, &p);
    assert_eq!(manager.cached_blocks(), 1);
    drop(b);
    assert_eq!(manager.cached_snapshot().1.len(), 1);
    drop(a);
    assert_eq!(manager.free_blocks(), 6);
    let plain = BlockManager::new(4, 2);
    let (mut c, cached) = plain.allocate_prefix(&p, 3).expect("c");
    plain.register(&mut c, &p);
    assert_eq!((cached, plain.cached_blocks(), plain.cached_prefix_tokens(&p)), (0, 0, 0));
}

#[test]
fn split_and_absorb_keep_the_prefix_hashes() {
    let manager = cached_pool(8, 2);
    let p: Vec<u32> = (0..7).collect();
    let (mut a, _) = manager.allocate_prefix(&p, 7).expect("4");
    manager.register(&mut a, &p);
    drop(a);
    let (mut whole, cached) = manager.allocate_prefix(&p, 8).expect("4");
    assert_eq!(cached, 6);
    let tail = whole.split_off(3);
    assert_eq!((whole.ids().len(), tail.ids().len()), (3, 1));
    whole.absorb(tail).expect("same pool");
    let longer: Vec<u32> = (0..9).collect();
    manager.register(&mut whole, &longer);
    assert_eq!(manager.cached_blocks(), 4, "the fourth block joins the chain");
}

#[test]
fn a_shared_prefix_is_freed_by_its_last_holder_and_never_double_freed() {
    let manager = BlockManager::new(8, 4);
    let parent = manager.allocate(3).expect("3");
    let shared = parent.share_prefix(2);
    assert_eq!(shared.ids(), &parent.ids()[..2]);
    assert_eq!(manager.free_blocks(), 5, "sharing takes no new block");
    let more = parent.share_prefix(99);
    assert_eq!(more.ids(), parent.ids(), "at most every block");
    drop(parent);
    assert_eq!(manager.free_blocks(), 5, "the shared blocks stay held; the parent's third too (held by `more`)");
    drop(more);
    assert_eq!(manager.free_blocks(), 6);
    drop(shared);
    assert_eq!(manager.free_blocks(), 8);
}
