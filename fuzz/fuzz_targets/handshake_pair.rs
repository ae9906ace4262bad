//! Fuzz both sides of the link hand-shake over a network that cuts, drops, duplicates and reorders (`clan_wire::fuzzing::handshake_pair`).
//! Run: `cargo fuzz run handshake_pair` (seed corpus: `fuzz/corpus/handshake_pair`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| clan_wire::fuzzing::handshake_pair(data));
