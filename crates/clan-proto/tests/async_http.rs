//! hyper's HTTP/1 server and client, unmodified, over clan streams (the example's code),
//! within a host and across a link; plus async event-queue waits.

#[path = "../examples/http_over_clan.rs"]
#[allow(dead_code)]
mod example;

use std::time::Duration;

use clan::{LocalTransport, Nic, NicConfig};
use clan_proto::stream::StreamConfig;
use clan_proto::tokio::{AsyncEventQueue, Reactor};

async fn http(link: bool) {
    let cfg = || NicConfig {
        local_transport: if link { LocalTransport::Link } else { LocalTransport::SharedMemory },
        ..NicConfig::default()
    };
    let (sn, cn) = (Nic::open(cfg()).unwrap(), Nic::open(cfg()).unwrap());
    let server = Reactor::new(&sn).unwrap();
    let listener = server.bind(StreamConfig { ring: 16 << 10, ..StreamConfig::default() }).unwrap();
    let addr = listener.local_addr();
    tokio::spawn(example::serve(listener));
    let client = Reactor::new(&cn).unwrap();
    let big: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    let leaked: &'static [u8] = Box::leak(big.clone().into_boxed_slice());
    // Several connections at once.
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            example::requests(
                &client,
                addr,
                vec![
                    ("GET", "/hello", Vec::new()),
                    ("POST", "/echo", leaked.to_vec()),
                    ("GET", "/missing", Vec::new()),
                    ("POST", "/echo", b"small".to_vec()),
                ],
            )
            .await
            .unwrap()
        }));
    }
    for t in tasks {
        let answers = t.await.unwrap();
        assert_eq!(answers[0], (200, b"hello over clan".to_vec()));
        assert_eq!(answers[1].0, 200);
        assert!(answers[1].1 == big, "a 1 MB body echoed intact through a 16 KiB ring");
        assert_eq!(answers[2].0, 404);
        assert_eq!(answers[3], (200, b"small".to_vec()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hyper_over_shared_memory() {
    tokio::time::timeout(Duration::from_secs(120), http(false)).await.expect("no hang");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hyper_over_a_link() {
    tokio::time::timeout(Duration::from_secs(120), http(true)).await.expect("no hang");
}

#[tokio::test(flavor = "current_thread")]
async fn event_queues_can_be_awaited() {
    let nic = Nic::open_default().unwrap();
    let q = nic.event_queue(clan::EventQueueConfig::default()).unwrap();
    let aq = AsyncEventQueue::new(q.clone()).unwrap();
    let poster = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        assert!(q.post_user(42));
    });
    let ev = tokio::time::timeout(Duration::from_secs(30), aq.wait()).await.expect("woken").unwrap();
    assert_eq!(ev, clan::Event::User(42));
    poster.join().unwrap();
}
