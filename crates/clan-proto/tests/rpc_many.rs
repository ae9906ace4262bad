//! An RPC server with thousands of connections (past `rpc::PREFETCH_FROM` parties in the
//! process): every request is taken, answered once and correctly, in batches of events
//! (`RpcServer::handle_event`'s look-ahead), while clients come and go with calls in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clan::Nic;
use clan_proto::rpc::{PREFETCH_FROM, RpcClient, RpcConfig, RpcServer, live_parties};

#[path = "../../clan/tests/util/mod.rs"]
mod util;

fn answer(req: &[u8]) -> Vec<u8> {
    req.iter().rev().map(|b| b ^ 0x5a).collect()
}

#[test]
fn thousands_of_connections_with_all_their_calls_in_flight_are_each_answered_once() {
    let _wd = util::Watchdog::new("thousands of RPC connections", Duration::from_secs(240));
    let nic = Nic::open_default().unwrap();
    // Client and server sides together past the threshold, with room.
    let clients = PREFETCH_FROM / 2 + 64;
    let cfg = RpcConfig { max_msg: 64, ..RpcConfig::default() };
    let mut server = RpcServer::bind(&nic, cfg.clone(), clients as u32 + 16).unwrap();
    let addr = server.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let serving = std::thread::spawn(move || {
        let mut served = 0u64;
        while !s2.load(Ordering::Acquire) {
            served += server
                .run_once(Some(Duration::from_millis(5)), &mut |_, req, reply| {
                    let _ = reply.write(&answer(&req.to_vec()));
                })
                .unwrap();
        }
        (served, server.connections())
    });
    let mut cs: Vec<RpcClient> = (0..clients).map(|_| RpcClient::connect(&nic, addr, &cfg).unwrap()).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while live_parties() < PREFETCH_FROM {
        assert!(Instant::now() < deadline, "the server did not accept every client");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut answered = 0u64;
    for round in 0u8..4 {
        // Every client's call in flight at once: the server's queue holds many requests,
        // handled in batches.
        for (i, c) in cs.iter_mut().enumerate() {
            let req = [round, (i >> 8) as u8, i as u8, 7];
            c.send_with(|w| w.write(&req)).unwrap();
        }
        if round == 2 {
            // A hundred clients go with their calls in flight (their requests may sit in a
            // batch being handled): the others are answered all the same.
            cs.truncate(clients - 100);
        }
        for (i, c) in cs.iter_mut().enumerate() {
            let req = [round, (i >> 8) as u8, i as u8, 7];
            let reply = c.wait_reply(Some(Duration::from_secs(30)), |r| r.to_vec()).unwrap();
            assert_eq!(reply, answer(&req), "client {i}, round {round}");
            answered += 1;
        }
    }
    stop.store(true, Ordering::Release);
    let (served, _) = serving.join().unwrap();
    // Every call of a client that stayed was answered; those of the departed ones at most
    // once each.
    assert!(served >= answered && served <= answered + 100, "served {served}, answered {answered}");
}
