//! A map for the few entries most of its instances hold: a vector searched in order while
//! it holds at most [`FEW`] of them, a hash map beyond.
//!
//! Every aperture keeps a few private maps about its tripwires (by queue index, by line, by
//! page: `cam::CamOwner` and `clan`'s tripwire records), and a connection has an aperture
//! on each side. Nearly all of them hold one entry. A `HashMap` with one entry allocates
//! room for three and its control bytes (100–160 bytes each, four such maps an aperture);
//! this map allocates room for one (16–40 bytes), finds it with one comparison, and becomes
//! a hash map only for the rare aperture that watches many places.
//!
//! Safe code only; no order of iteration is promised.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash};

/// Entries kept in the vector; one more makes it a hash map.
pub const FEW: usize = 8;

/// Keys of these maps are small integers the owner chose (queue indexes, line and page
/// numbers): a fast hash suffices (a caller that picks colliding ranges slows only its own
/// process's tripwire creation).
type Big<K, V> = HashMap<K, V, BuildHasherDefault<rustc_hash::FxHasher>>;

/// A map of a few entries (see the module's text).
#[derive(Debug, Clone)]
pub struct SmallMap<K, V> {
    repr: Repr<K, V>,
}

#[derive(Debug, Clone)]
enum Repr<K, V> {
    Few(Vec<(K, V)>),
    Many(Big<K, V>),
}

impl<K, V> Default for SmallMap<K, V> {
    fn default() -> Self {
        SmallMap { repr: Repr::Few(Vec::new()) }
    }
}

impl<K: Eq + Hash + Copy, V> SmallMap<K, V> {
    /// An empty map (allocates nothing).
    pub fn new() -> Self {
        Self::default()
    }

    /// The entries.
    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::Few(v) => v.len(),
            Repr::Many(m) => m.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The value of `k`.
    pub fn get(&self, k: &K) -> Option<&V> {
        match &self.repr {
            Repr::Few(v) => v.iter().find(|(x, _)| x == k).map(|(_, v)| v),
            Repr::Many(m) => m.get(k),
        }
    }

    /// The value of `k`, to change.
    pub fn get_mut(&mut self, k: &K) -> Option<&mut V> {
        match &mut self.repr {
            Repr::Few(v) => v.iter_mut().find(|(x, _)| x == k).map(|(_, v)| v),
            Repr::Many(m) => m.get_mut(k),
        }
    }

    /// The value of `k`, made by `make` if there is none.
    pub fn get_or_insert_with(&mut self, k: K, make: impl FnOnce() -> V) -> &mut V {
        if self.get(&k).is_none() {
            self.insert(k, make());
        }
        match &mut self.repr {
            Repr::Few(v) => match v.iter_mut().find(|(x, _)| *x == k) {
                Some((_, v)) => v,
                None => unreachable!("inserted above"),
            },
            Repr::Many(m) => m.entry(k).or_insert_with(|| unreachable!("inserted above")),
        }
    }

    /// Set the value of `k`; the one it replaces.
    pub fn insert(&mut self, k: K, val: V) -> Option<V> {
        match &mut self.repr {
            Repr::Few(v) => {
                if let Some((_, old)) = v.iter_mut().find(|(x, _)| *x == k) {
                    return Some(std::mem::replace(old, val));
                }
                if v.len() < FEW {
                    if v.len() == v.capacity() {
                        // Room for one, then doubling: most maps never hold a second.
                        v.reserve_exact(v.len().max(1));
                    }
                    v.push((k, val));
                    return None;
                }
                let mut m: Big<K, V> = Big::with_capacity_and_hasher(2 * FEW, Default::default());
                m.extend(std::mem::take(v));
                m.insert(k, val);
                self.repr = Repr::Many(m);
                None
            }
            Repr::Many(m) => m.insert(k, val),
        }
    }

    /// Take `k` out; its value.
    pub fn remove(&mut self, k: &K) -> Option<V> {
        match &mut self.repr {
            Repr::Few(v) => {
                let i = v.iter().position(|(x, _)| x == k)?;
                Some(v.swap_remove(i).1)
            }
            Repr::Many(m) => {
                let old = m.remove(k);
                if m.len() <= FEW / 2 {
                    // Back to the vector (not at FEW: a map around it would switch at each
                    // insert and remove).
                    let few: Vec<(K, V)> = m.drain().collect();
                    self.repr = Repr::Few(few);
                }
                old
            }
        }
    }

    /// The entries, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        let (few, many) = match &self.repr {
            Repr::Few(v) => (Some(v.iter().map(|(k, v)| (k, v))), None),
            Repr::Many(m) => (None, Some(m.iter())),
        };
        few.into_iter().flatten().chain(many.into_iter().flatten())
    }

    /// The values, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }

    /// Bytes allocated for the entries (the vector's or the table's, roughly), for tests.
    pub fn allocated(&self) -> usize {
        match &self.repr {
            Repr::Few(v) => v.capacity() * std::mem::size_of::<(K, V)>(),
            Repr::Many(m) => m.capacity() * (std::mem::size_of::<(K, V)>() + 1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, u32),
        Remove(u8),
        Bump(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Keys from a small range, so that maps grow past `FEW` and shrink back.
        let k = 0u8..24;
        prop_oneof![
            (k.clone(), any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            k.clone().prop_map(Op::Remove),
            k.prop_map(Op::Bump),
        ]
    }

    proptest! {
        /// Whatever the sequence of changes, the map holds what a `HashMap` would.
        #[test]
        fn it_holds_what_a_hash_map_would(ops in proptest::collection::vec(op(), 0..200)) {
            let mut m = SmallMap::new();
            let mut model = std::collections::HashMap::new();
            for o in ops {
                match o {
                    Op::Insert(k, v) => prop_assert_eq!(m.insert(k, v), model.insert(k, v)),
                    Op::Remove(k) => prop_assert_eq!(m.remove(&k), model.remove(&k)),
                    Op::Bump(k) => {
                        *m.get_or_insert_with(k, || 0) += 1;
                        *model.entry(k).or_insert(0) += 1;
                    }
                }
                prop_assert_eq!(m.len(), model.len());
                prop_assert_eq!(m.is_empty(), model.is_empty());
                for k in 0u8..24 {
                    prop_assert_eq!(m.get(&k), model.get(&k));
                }
                let mut seen: Vec<(u8, u32)> = m.iter().map(|(&k, &v)| (k, v)).collect();
                seen.sort_unstable();
                let mut want: Vec<(u8, u32)> = model.iter().map(|(&k, &v)| (k, v)).collect();
                want.sort_unstable();
                prop_assert_eq!(seen, want);
                prop_assert_eq!(m.values().count(), model.len());
            }
        }
    }

    #[test]
    fn one_entry_takes_room_for_one() {
        let mut m: SmallMap<u64, u32> = SmallMap::new();
        assert_eq!(m.allocated(), 0, "an empty map allocates nothing");
        m.insert(7, 1);
        assert_eq!(m.allocated(), 16, "room for one entry");
        m.insert(8, 2);
        m.insert(9, 3);
        assert_eq!(m.allocated(), 4 * 16, "then doubling");
        *m.get_mut(&8).unwrap() += 10;
        assert_eq!(m.get(&8), Some(&12));
    }

    #[test]
    fn it_becomes_a_table_past_few_and_a_vector_again_well_below() {
        let mut m: SmallMap<u32, u32> = SmallMap::new();
        for k in 0..=FEW as u32 {
            m.insert(k, k);
        }
        assert!(matches!(m.repr, Repr::Many(_)));
        for k in 0..=FEW as u32 {
            assert_eq!(m.get(&k), Some(&k));
        }
        // Down to FEW / 2 + 1: still a table; one less: a vector.
        for k in 0..FEW as u32 / 2 {
            m.remove(&k);
        }
        assert!(matches!(m.repr, Repr::Many(_)));
        m.remove(&(FEW as u32 / 2));
        assert!(matches!(m.repr, Repr::Few(_)));
        assert_eq!(m.len(), FEW / 2);
        for k in FEW as u32 / 2 + 1..=FEW as u32 {
            assert_eq!(m.get(&k), Some(&k));
        }
    }
}
