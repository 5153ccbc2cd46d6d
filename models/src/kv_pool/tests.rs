//! Pool bookkeeping: tables, rollback, sharing, copy-on-write, the prefix index, eviction and
//! fullness, with recognisable K/V values.

use super::*;

const B: usize = BLOCK_SIZE;

fn layout() -> KvLayout {
    KvLayout {
        slots: vec![
            SlotShape {
                kv_heads: 2,
                head_dim: 4,
            },
            SlotShape {
                kv_heads: 1,
                head_dim: 8,
            },
        ],
    }
}

/// The K row of `token` at `pos`: distinct per (token, position, slot).
fn row(token: u32, pos: usize, slot: usize, width: usize) -> Vec<f32> {
    (0..width)
        .map(|i| (token as usize * 100_000 + pos * 100 + slot * 10 + i) as f32)
        .collect()
}

/// Appends `tokens` and writes their K (and V = -K) in every slot, as a forward would.
fn feed(pool: &mut KvPool, seq: SeqId, tokens: &[u32]) {
    let start = pool.len(seq).unwrap();
    pool.append(seq, tokens).unwrap();
    for (i, &t) in tokens.iter().enumerate() {
        let (b, off) = pool.locate(seq, start + i).unwrap();
        for slot in 0..2 {
            let k = row(t, start + i, slot, 8);
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            pool.write(slot, b, off, &k, &v);
        }
    }
    pool.index_full_blocks(seq).unwrap();
}

/// Every position's K and V in every slot are what `feed` wrote for `tokens`.
fn check(pool: &KvPool, seq: SeqId, tokens: &[u32]) {
    assert_eq!(pool.tokens(seq).unwrap(), tokens);
    for slot in 0..2 {
        let (k, v) = pool.read_rows(seq, slot, 0..tokens.len()).unwrap();
        for (p, &t) in tokens.iter().enumerate() {
            let want = row(t, p, slot, 8);
            assert_eq!(k[p * 8..(p + 1) * 8], want[..], "slot {slot} pos {p}");
            assert_eq!(v[p * 8], -want[0]);
        }
    }
}

fn ids(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt).collect()
}

#[test]
fn append_truncate_release_account_blocks() {
    let mut pool = KvPool::new(layout(), 8).unwrap();
    let a = pool.create();
    let t = ids(2 * B + 5, 1);
    assert_eq!(pool.blocks_needed(a, t.len()).unwrap(), 3);
    feed(&mut pool, a, &t[..B + 3]);
    feed(&mut pool, a, &t[B + 3..]);
    check(&pool, a, &t);
    assert_eq!(pool.blocks(a).unwrap().len(), 3);
    assert_eq!(pool.stats().used_blocks, 3);
    pool.truncate(a, B).unwrap();
    assert_eq!(pool.blocks(a).unwrap().len(), 1, "tail blocks released");
    assert_eq!(pool.stats().used_blocks, 1);
    // Regrow over the truncated positions with other tokens.
    let u = [&t[..B], &ids(10, 500)[..]].concat();
    feed(&mut pool, a, &u[B..]);
    check(&pool, a, &u);
    assert!(pool.truncate(a, u.len() + 1).is_err());
    pool.release(a).unwrap();
    assert!(!pool.contains(a));
    assert!(pool.len(a).is_err(), "a released handle is rejected");
    let b = pool.create();
    assert!(pool.len(a).is_err(), "also after its index is reused");
    assert_eq!(pool.len(b).unwrap(), 0);
    assert_eq!(pool.stats().used_blocks, 0);
}

#[test]
fn fork_shares_full_blocks_and_copies_on_write() {
    let mut pool = KvPool::new(layout(), 16).unwrap();
    let a = pool.create();
    let t = ids(B + 10, 3);
    feed(&mut pool, a, &t);
    let used = pool.stats().used_blocks;
    let b = pool.fork(a, B + 4).unwrap();
    assert_eq!(
        pool.blocks(b).unwrap()[0],
        pool.blocks(a).unwrap()[0],
        "full block shared"
    );
    assert_ne!(
        pool.blocks(b).unwrap()[1],
        pool.blocks(a).unwrap()[1],
        "partial one copied"
    );
    assert_eq!(pool.stats().used_blocks, used + 1);
    check(&pool, b, &t[..B + 4]);
    // b diverges inside its own block; a is untouched.
    let bt = [&t[..B + 4], &ids(3, 900)[..]].concat();
    feed(&mut pool, b, &bt[B + 4..]);
    check(&pool, a, &t);
    check(&pool, b, &bt);
    // b rolls back into the shared block and rewrites it: copy on write, a keeps its data.
    pool.truncate(b, 5).unwrap();
    let bt2 = [&t[..5], &ids(4, 77)[..]].concat();
    assert_eq!(pool.blocks_needed(b, 4).unwrap(), 1, "the copy");
    feed(&mut pool, b, &bt2[5..]);
    assert_ne!(pool.blocks(b).unwrap()[0], pool.blocks(a).unwrap()[0]);
    check(&pool, a, &t);
    check(&pool, b, &bt2);
    assert!(pool.fork(a, t.len() + 1).is_err());
}

#[test]
fn prefix_index_adopts_longest_chain_and_survives_release() {
    let mut pool = KvPool::new(layout(), 16).unwrap();
    let a = pool.create();
    let t = ids(3 * B + 7, 5);
    feed(&mut pool, a, &t);
    pool.release(a).unwrap();
    assert_eq!(pool.stats().cached_blocks, 3, "full blocks stay cached");

    // Same first two blocks, then a different third.
    let mut u = t.clone();
    u[2 * B + 1] += 1;
    let b = pool.create();
    assert_eq!(pool.adopt_prefix(b, &u).unwrap(), 2 * B);
    check(&pool, b, &t[..2 * B]);
    assert_eq!(pool.stats().cached_blocks, 1);
    let s = pool.stats();
    assert_eq!(
        (s.prefix_query_tokens, s.prefix_hit_tokens),
        (3 * B as u64, 2 * B as u64)
    );
    feed(&mut pool, b, &u[2 * B..]);
    check(&pool, b, &u);
    assert!(
        pool.adopt_prefix(b, &u).is_err(),
        "only an empty sequence adopts"
    );

    // A different first block matches nothing, even with equal later blocks.
    let mut w = t.clone();
    w[0] += 1;
    let c = pool.create();
    assert_eq!(pool.adopt_prefix(c, &w).unwrap(), 0);

    // Rolling back into an indexed block and rewriting it takes it out of the index.
    let d = pool.create();
    assert_eq!(
        pool.adopt_prefix(d, &t).unwrap(),
        3 * B,
        "t's third block was still cached"
    );
    pool.release(b).unwrap();
    pool.truncate(d, B + 3).unwrap();
    // Block 1 is now shared by nobody else: d writes in place and unindexes it.
    feed(&mut pool, d, &ids(2, 4000));
    let e = pool.create();
    assert_eq!(
        pool.adopt_prefix(e, &t).unwrap(),
        B,
        "block 1 no longer matches t"
    );
}

#[test]
fn full_pool_errors_evicts_lru_and_leaves_sequences_intact() {
    let mut pool = KvPool::new(layout(), 3).unwrap();
    let a = pool.create();
    let t = ids(2 * B, 9);
    feed(&mut pool, a, &t);
    let b = pool.create();
    let u = ids(B + 1, 11);
    let err = pool.append(b, &u).unwrap_err();
    assert!(
        matches!(
            err,
            Error::KvPoolFull {
                needed: 2,
                available: 1
            }
        ),
        "{err}"
    );
    assert_eq!(pool.len(b).unwrap(), 0, "all or nothing");
    // Releasing a caches its blocks; b's allocation evicts the oldest first.
    pool.release(a).unwrap();
    assert_eq!(pool.available_blocks(), 3);
    feed(&mut pool, b, &u);
    check(&pool, b, &u);
    let c = pool.create();
    // Release unrefs in table order, so t's first block was the least recently released.
    assert_eq!(
        pool.adopt_prefix(c, &t).unwrap(),
        0,
        "t's first block was evicted"
    );
    assert!(KvPool::new(layout(), 0).is_err());
    assert!(KvPool::new(KvLayout { slots: vec![] }, 4).is_err());
}

#[test]
fn the_cache_budget_bounds_cached_blocks_and_the_arena_over_many_prompts() {
    // Room for 64 blocks, but at most 3 kept cached: 200 distinct two-block prompts, two at a
    // time, must not grow the arena past the running peak (4 blocks) plus the budget.
    let mut pool = KvPool::new(layout(), 64).unwrap();
    pool.set_cache_budget(3);
    let mut last = Vec::new();
    for round in 0..100u32 {
        let (a, b) = (pool.create(), pool.create());
        let (ta, tb) = (ids(2 * B, 1000 + 2 * round), ids(2 * B, 1001 + 2 * round));
        feed(&mut pool, a, &ta);
        feed(&mut pool, b, &tb);
        pool.release(a).unwrap();
        pool.release(b).unwrap();
        let s = pool.stats();
        assert!(s.cached_blocks <= 3, "round {round}: {s:?}");
        assert!(
            s.arena_blocks <= 8,
            "round {round}: the arena grew to {s:?}"
        );
        last = tb;
    }
    // The most recently released prompt is still found; an old one is not.
    let c = pool.create();
    assert_eq!(pool.adopt_prefix(c, &last).unwrap(), 2 * B);
    check(&pool, c, &last);
    let d = pool.create();
    assert_eq!(pool.adopt_prefix(d, &ids(2 * B, 1000)).unwrap(), 0);
    // Lowering the budget drops the excess at once; 0 keeps nothing.
    pool.release(c).unwrap();
    assert_eq!(pool.stats().cached_blocks, 3);
    pool.set_cache_budget(0);
    assert_eq!(pool.stats().cached_blocks, 0);
    let e = pool.create();
    assert_eq!(pool.adopt_prefix(e, &last).unwrap(), 0);
    assert_eq!(pool.available_blocks(), 64);
}

#[test]
fn chain_keys_are_the_keys_a_sequence_enters_and_adopts() {
    let mut pool = KvPool::new(layout(), 16).unwrap();
    let a = pool.create();
    let t = ids(2 * B + 5, 21);
    feed(&mut pool, a, &t);
    let keys = chain_keys(&t);
    assert_eq!(keys.len(), 2, "full blocks only");
    assert_eq!(pool.block_keys(a).unwrap(), &keys[..]);
    assert_eq!(
        chain_keys(&t[..B]),
        keys[..1],
        "a key names its whole prefix"
    );
    let mut u = t.clone();
    u[0] += 1;
    assert_ne!(
        chain_keys(&u)[1],
        keys[1],
        "a changed first block changes every key after it"
    );
    let b = pool.create();
    assert_eq!(pool.adopt_prefix(b, &t).unwrap(), 2 * B);
    assert_eq!(pool.block_keys(b).unwrap(), &keys[..]);
}

/// The donor region as a drafter maps it.
fn reader(pool: &KvPool) -> specula_protocol::donor::DonorReader {
    let (region, shm, layout) = pool.donor_share().expect("exported");
    specula_protocol::donor::DonorReader::new(region, shm, layout).unwrap()
}

#[test]
fn exported_slots_live_in_the_donor_region_through_growth_reuse_and_copy_on_write() {
    let mut pool = KvPool::new(layout(), 64).unwrap();
    let a = pool.create();
    let t = ids(B + 3, 1);
    // Exported mid-stream: what was written moves over, the forward then writes there.
    feed(&mut pool, a, &t[..5]);
    pool.export_donors(&[(1, 9)]).unwrap();
    assert_eq!(pool.donor_layers(), &[(1, 9)]);
    feed(&mut pool, a, &t[5..]);
    check(&pool, a, &t);
    let first = pool.donor_region().unwrap();
    let table = pool.donor_table(a, t.len()).unwrap().unwrap();
    assert!(
        table.iter().all(|b| b.epoch.is_multiple_of(2)),
        "announced stable"
    );
    let r = reader(&pool);
    let rows = r.rows(&table, t.len()).unwrap();
    let (k, v) = rows.copy_rows(0, 0..t.len()).unwrap();
    let (pk, pv) = pool.read_rows(a, 1, 0..t.len()).unwrap();
    assert_eq!(
        (&k, &v),
        (&pk, &pv),
        "the drafter reads what attention reads"
    );
    // The region's bytes are the pool's storage: a write shows through the mapping.
    let (b, off) = pool.locate(a, 2).unwrap();
    pool.write(1, b, off, &[7.0; 8], &[8.0; 8]);
    assert_eq!(rows.copy_rows(0, 2..3).unwrap().0, vec![7.0; 8]);
    let k2 = row(t[2], 2, 1, 8);
    let v2: Vec<f32> = k2.iter().map(|x| -x).collect();
    pool.write(1, b, off, &k2, &v2);
    // Growth: a bigger region, a new id, rows and epochs carried.
    let b2 = pool.create();
    feed(&mut pool, b2, &ids(8 * B, 50));
    assert_ne!(pool.donor_region().unwrap(), first);
    assert!(pool.donor_regrow_bytes() > 0);
    check(&pool, a, &t);
    let grown = reader(&pool);
    grown.rows(&table, t.len()).unwrap().check().unwrap();
    // Rollback keeps the committed rows; a freed block is claimed before its next owner writes.
    pool.truncate(a, B).unwrap();
    grown.rows(&table[..1], B).unwrap().check().unwrap();
    let (tail, epoch) = (table[1].block, table[1].epoch);
    let c = pool.create();
    feed(&mut pool, c, &ids(3, 900));
    assert_eq!(
        pool.blocks(c).unwrap()[0],
        tail,
        "the freed block is reused"
    );
    assert!(
        grown.rows(&table, t.len()).unwrap().check().is_err(),
        "torn"
    );
    let now = pool.donor_table(c, 3).unwrap().unwrap()[0];
    assert!(now.epoch > epoch && now.epoch.is_multiple_of(2));
    // Copy-on-write of a shared partial block copies the exported slot too.
    let f = pool.fork(c, 2).unwrap();
    check(&pool, f, &ids(3, 900)[..2]);
    // Moved back into the arena: the same rows.
    pool.export_donors(&[]).unwrap();
    assert!(pool.donor_region().is_none() && pool.donor_table(c, 3).unwrap().is_none());
    check(&pool, c, &ids(3, 900));
    check(&pool, a, &t[..B]);
    assert!(pool.export_donors(&[(2, 0)]).is_err(), "no slot 2");
    assert!(
        pool.export_donors(&[(1, 0), (1, 3)]).is_err(),
        "a slot twice"
    );
    assert!(pool.donor_table(c, 4).is_err(), "past the length");
}
