//! Handles held by value on the data path: a part of a mapping that keeps it mapped
//! (`Segment::whole`, `Segment::alias`) and an index whose view is held inline (`CamRef`).

use std::sync::Arc;

use clan_shm::cam::CamLayout;
use clan_shm::eq::CamMap;
use clan_shm::segment::{Access, Segment, SegmentError};

#[test]
fn a_whole_part_keeps_its_mapping_and_sees_its_bytes() {
    let seg = Arc::new(Segment::anonymous(8192).unwrap());
    seg.write(100, b"shared").unwrap();
    let part = Segment::whole(&seg);
    assert_eq!((part.len(), part.access(), part.as_ptr()), (8192, Access::ReadWrite, seg.as_ptr()));
    let alias = part.alias().expect("a part has an alias");
    assert!(seg.alias().is_none(), "a mapping is unmapped by its one owner: it has no alias");
    drop(seg);
    drop(part);
    // The mapping is still there: the alias keeps it.
    let mut got = [0u8; 6];
    alias.read(100, &mut got).unwrap();
    assert_eq!(&got, b"shared");
    alias.write(8190, b"ok").unwrap();
    assert_eq!(alias.write(8191, b"no"), Err(SegmentError::OutOfBounds { offset: 8191, len: 2, size: 8192 }));
}

#[test]
fn an_alias_of_a_part_is_bounded_like_the_part() {
    let seg = Arc::new(Segment::anonymous(3 * 4096).unwrap());
    let part = Segment::sub(&seg, 4096, 4096).unwrap();
    part.write(0, b"middle").unwrap();
    let alias = part.alias().unwrap();
    drop(part);
    let mut got = [0u8; 6];
    seg.read(4096, &mut got).unwrap();
    assert_eq!(&got, b"middle");
    assert_eq!(alias.as_ptr(), seg.as_ptr().wrapping_add(4096));
    assert!(alias.read(4096, &mut got).is_err(), "the alias ends where the part did");
}

#[test]
fn a_cam_handle_outlives_its_map_handle() {
    let layout = CamLayout::new(4096, 32);
    let seg = Arc::new(Segment::anonymous(layout.size.next_multiple_of(4096)).unwrap());
    let map = Arc::new(CamMap::new(seg, 0, 4096, 32).unwrap());
    let h = map.handle();
    assert!(Arc::ptr_eq(h.map(), &map));
    drop(map);
    // The view still points into live memory: the handle keeps the index mapped.
    let v = h.view();
    assert_eq!((v.len, v.entries.len()), (4096, 32));
    v.header.state.store(7, std::sync::atomic::Ordering::Release);
    assert_eq!(h.clone().view().header.state.load(std::sync::atomic::Ordering::Acquire), 7);
}
