//! Rendezvous (highest random weight) hashing: each key ranks every endpoint (a model server, or a
//! replica taking orphaned runs) by a hash of the two, so a key keeps its first endpoint while the
//! fleet changes around it, and when an endpoint leaves only the keys it ranked first move, each
//! to its own next one (load stays spread). The hash is fixed (FNV-1a, then a SplitMix64 finish), so every replica of every
//! version ranks alike.

/// The weight of `endpoint` for `key`.
pub fn weight(key: &str, endpoint: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    for byte in key.bytes().chain([0xff]).chain(endpoint.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(PRIME);
    }
    split_mix(hash)
}

/// SplitMix64's finalizer: spreads FNV's low-entropy high bits.
fn split_mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The positions of `endpoints` in `key`'s order: highest weight first (ties by name).
pub fn order<'a>(key: &str, endpoints: impl Iterator<Item = &'a str>) -> Vec<usize> {
    let mut ranked: Vec<(u64, &str, usize)> = endpoints
        .enumerate()
        .map(|(i, endpoint)| (weight(key, endpoint), endpoint, i))
        .collect();
    ranked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    ranked.into_iter().map(|(_, _, i)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("http://10.0.0.{i}:8000/v1")).collect()
    }

    fn first(key: &str, fleet: &[String]) -> String {
        fleet[order(key, fleet.iter().map(String::as_str))[0]].clone()
    }

    #[test]
    fn equal_endpoints_take_equal_shares_of_the_keys() {
        let fleet = endpoints(4);
        let mut counts = std::collections::HashMap::new();
        for run in 0..8000 {
            *counts.entry(first(&format!("run-{run}"), &fleet)).or_insert(0) += 1;
        }
        for (endpoint, count) in &counts {
            assert!((1700..=2300).contains(count), "{endpoint}: {count} of 8000");
        }
        assert_eq!(counts.len(), 4);
    }

    #[test]
    fn only_the_keys_of_an_endpoint_that_left_move_and_they_spread() {
        let fleet = endpoints(4);
        let smaller: Vec<String> = fleet[..3].to_vec();
        let mut moved_to = std::collections::HashMap::new();
        for run in 0..4000 {
            let key = format!("run-{run}");
            let (before, after) = (first(&key, &fleet), first(&key, &smaller));
            if before == fleet[3] {
                *moved_to.entry(after).or_insert(0) += 1;
            } else {
                assert_eq!(before, after, "{key} moved though its endpoint stayed");
            }
        }
        assert_eq!(moved_to.len(), 3, "{moved_to:?}");
    }

    #[test]
    fn the_order_is_every_endpoint_once_and_the_same_each_time() {
        let fleet = endpoints(5);
        let once = order("conversation-7", fleet.iter().map(String::as_str));
        let mut sorted = once.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, [0, 1, 2, 3, 4]);
        assert_eq!(once, order("conversation-7", fleet.iter().map(String::as_str)));
        // The same weight on every machine and version.
        assert_eq!(weight("run-1", "http://a:1/v1"), weight("run-1", "http://a:1/v1"));
        assert_ne!(weight("run-1", "http://a:1/v1"), weight("run-2", "http://a:1/v1"));
    }
}
