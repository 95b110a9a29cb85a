//! Where each group's voters should be, in a cluster of more than `replicas` servers: the plan that
//! `holdfast member place` carries out with [`Client::add_member`](crate::Client::add_member) and
//! [`Client::remove_member`](crate::Client::remove_member).
//!
//! A pure function of the groups' current voters, the servers that should hold groups and the number
//! of voters per group. It moves as few voters as it can:
//! 1. a group keeps its voters that are among the servers (a server left out is drained);
//! 2. a group with too many sheds the busiest (the server that is a voter of the most groups; the
//!    highest id among equals), and a group with too few takes the least busy (the lowest id among
//!    equals);
//! 3. then, while the busiest server holds two groups more than the least busy one, the lowest-numbered
//!    group that has the first and not the second swaps them.
//!
//! So every server ends a voter of `groups * replicas / servers` groups, rounded down or up, and a
//! cluster already so placed is left alone. The caller adds a group's new voters before it removes
//! the old ones, so a group never has fewer voters than the fewer of what it had and `replicas`.

use std::collections::{BTreeMap, BTreeSet};

/// Voters per group this accepts: odd (an even count tolerates no more failures than one fewer), at
/// least three (a removal that leaves fewer is refused without `force`) and at most seven.
pub const MIN_REPLICAS: usize = 3;
pub const MAX_REPLICAS: usize = 7;

/// The voters each group should have (indexed like `current`), or why there is no such placement.
pub fn plan(
    current: &[BTreeSet<u64>],
    servers: &BTreeSet<u64>,
    replicas: usize,
) -> Result<Vec<BTreeSet<u64>>, String> {
    if replicas.is_multiple_of(2) || !(MIN_REPLICAS..=MAX_REPLICAS).contains(&replicas) {
        return Err(format!(
            "{replicas} voters per group: give an odd number from {MIN_REPLICAS} to {MAX_REPLICAS} (3 survives one failure, 5 two)"
        ));
    }
    if servers.len() < replicas {
        return Err(format!(
            "{replicas} voters per group need at least {replicas} servers; {} given",
            servers.len()
        ));
    }
    let mut target: Vec<BTreeSet<u64>> = current
        .iter()
        .map(|voters| voters.intersection(servers).copied().collect())
        .collect();
    let mut load: BTreeMap<u64, usize> = servers.iter().map(|&s| (s, 0)).collect();
    for voters in &target {
        for v in voters {
            *load.get_mut(v).expect("voters are among the servers") += 1;
        }
    }
    for voters in &mut target {
        while voters.len() > replicas {
            let busiest = *voters
                .iter()
                .max_by_key(|v| (load[*v], **v))
                .expect("more voters than replicas");
            voters.remove(&busiest);
            *load.get_mut(&busiest).expect("a server") -= 1;
        }
    }
    for voters in &mut target {
        while voters.len() < replicas {
            let idlest = *load
                .iter()
                .filter(|(s, _)| !voters.contains(*s))
                .min_by_key(|(s, n)| (**n, **s))
                .expect("at least `replicas` servers")
                .0;
            voters.insert(idlest);
            *load.get_mut(&idlest).expect("a server") += 1;
        }
    }
    loop {
        let (&busiest, &most) = load
            .iter()
            .max_by_key(|(s, n)| (**n, **s))
            .expect("servers");
        let (&idlest, &least) = load
            .iter()
            .min_by_key(|(s, n)| (**n, **s))
            .expect("servers");
        if most <= least + 1 {
            return Ok(target);
        }
        // One exists: the busiest is a voter of more groups than the idlest.
        let g = target
            .iter()
            .position(|v| v.contains(&busiest) && !v.contains(&idlest))
            .expect("a group the busiest holds and the idlest does not");
        target[g].remove(&busiest);
        target[g].insert(idlest);
        *load.get_mut(&busiest).expect("a server") -= 1;
        *load.get_mut(&idlest).expect("a server") += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ids: &[u64]) -> BTreeSet<u64> {
        ids.iter().copied().collect()
    }

    fn loads(target: &[BTreeSet<u64>], servers: &BTreeSet<u64>) -> BTreeMap<u64, usize> {
        let mut load: BTreeMap<u64, usize> = servers.iter().map(|&s| (s, 0)).collect();
        for v in target.iter().flatten() {
            *load.get_mut(v).unwrap() += 1;
        }
        load
    }

    /// Moves (one voter in, one out) from `current` to `target`.
    fn moves(current: &[BTreeSet<u64>], target: &[BTreeSet<u64>]) -> usize {
        current
            .iter()
            .zip(target)
            .map(|(c, t)| t.difference(c).count())
            .sum()
    }

    /// (groups, servers before, servers after, replicas, most moves allowed).
    type Case = (usize, &'static [u64], &'static [u64], usize, usize);

    /// Every group gets exactly `replicas` voters, all among the servers, each server within one of
    /// even, and no more moves than the case allows.
    #[test]
    fn placements_are_even_and_move_little() {
        let cases: &[Case] = &[
            // Five servers, every group on all of them: already placed.
            (8, &[1, 2, 3, 4, 5], &[1, 2, 3, 4, 5], 5, 0),
            // Two servers added, groups down to three voters: only removals and the moves to use 6 and 7.
            (8, &[1, 2, 3, 4, 5], &[1, 2, 3, 4, 5, 6, 7], 3, 8),
            (8, &[1, 2, 3, 4, 5], &[1, 2, 3, 4, 5, 6, 7], 5, 12),
            (4, &[1, 2, 3, 4, 5], &[1, 2, 3, 4, 5, 6, 7], 3, 6),
            // Three servers, three voters: nothing to do.
            (4, &[1, 2, 3], &[1, 2, 3], 3, 0),
            // Drain server 3 of five (five voters on five servers cannot stay five: down to three).
            (8, &[1, 2, 3, 4, 5], &[1, 2, 4, 5], 3, 0),
            // Double the servers.
            (
                16,
                &[1, 2, 3, 4, 5],
                &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
                5,
                40,
            ),
            (1, &[1, 2, 3, 4, 5], &[1, 2, 3, 4, 5, 6], 3, 0),
        ];
        for &(groups, before, after, replicas, most_moves) in cases {
            let current: Vec<BTreeSet<u64>> = vec![set(before); groups];
            let servers = set(after);
            let target = plan(&current, &servers, replicas).unwrap();
            let case = format!("{groups} groups, {before:?} -> {after:?}, {replicas} voters");
            assert_eq!(target.len(), groups, "{case}");
            for t in &target {
                assert_eq!(t.len(), replicas, "{case}: {target:?}");
                assert!(t.is_subset(&servers), "{case}: {target:?}");
            }
            let load = loads(&target, &servers);
            let (lo, hi) = (*load.values().min().unwrap(), *load.values().max().unwrap());
            assert!(hi <= lo + 1, "{case}: uneven {load:?}");
            assert!(
                moves(&current, &target) <= most_moves,
                "{case}: {} moves",
                moves(&current, &target)
            );
            // Placing again changes nothing.
            assert_eq!(plan(&target, &servers, replicas).unwrap(), target, "{case}");
        }
    }

    #[test]
    fn a_server_added_to_a_placed_cluster_takes_a_share_from_the_busiest() {
        let servers = set(&[1, 2, 3, 4, 5, 6, 7]);
        let placed = plan(&vec![set(&[1, 2, 3, 4, 5]); 8], &servers, 3).unwrap();
        let more = set(&[1, 2, 3, 4, 5, 6, 7, 8]);
        let target = plan(&placed, &more, 3).unwrap();
        // 24 voters over 8 servers: three each, so the new one takes three, one move each.
        assert_eq!(loads(&target, &more)[&8], 3);
        assert_eq!(moves(&placed, &target), 3);
    }

    #[test]
    fn impossible_placements_say_why() {
        let five = set(&[1, 2, 3, 4, 5]);
        let current = vec![five.clone(); 2];
        for (servers, replicas, why) in [
            (five.clone(), 4, "odd number"),
            (five.clone(), 0, "odd number"),
            (five.clone(), 9, "odd number"),
            (five.clone(), 1, "odd number"),
            (set(&[1, 2]), 3, "at least 3 servers"),
        ] {
            let e = plan(&current, &servers, replicas).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
    }
}
