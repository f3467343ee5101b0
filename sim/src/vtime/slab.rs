//! The live requests of a virtual-time run, by id: read for every token of every request, so
//! an id names its slot directly (low 32 bits) instead of going through a hash map. The high
//! bits count the slot's reuses, so an event for a request that has ended (a stall timer, a
//! late answer) finds nothing rather than the slot's next request.

/// Slots of `T`, each id unique for the run.
#[derive(Debug)]
pub struct Slab<T> {
    slots: Vec<(u64, Option<T>)>,
    free: Vec<u32>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { slots: Vec::new(), free: Vec::new(), len: 0 }
    }
}

impl<T> Slab<T> {
    /// Stores `value` under a new id.
    pub fn insert(&mut self, value: T) -> u64 {
        self.len += 1;
        if let Some(slot) = self.free.pop() {
            let entry = &mut self.slots[slot as usize];
            let id = entry.0 + (1 << 32);
            *entry = (id, Some(value));
            return id;
        }
        let slot = self.slots.len() as u64;
        // Ids start at 1 (0 is nobody's).
        let id = slot | (1 << 32);
        self.slots.push((id, Some(value)));
        id
    }

    pub fn get(&self, id: u64) -> Option<&T> {
        match self.slots.get(id as u32 as usize) {
            Some((held, value)) if *held == id => value.as_ref(),
            _ => None,
        }
    }

    pub fn get_mut(&mut self, id: u64) -> Option<&mut T> {
        match self.slots.get_mut(id as u32 as usize) {
            Some((held, value)) if *held == id => value.as_mut(),
            _ => None,
        }
    }

    pub fn remove(&mut self, id: u64) -> Option<T> {
        let slot = id as u32;
        let (held, value) = self.slots.get_mut(slot as usize)?;
        if *held != id {
            return None;
        }
        let value = value.take()?;
        self.len -= 1;
        self.free.push(slot);
        Some(value)
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ended_id_finds_nothing_after_its_slot_is_reused() {
        let mut s = Slab::default();
        let a = s.insert("a");
        let b = s.insert("b");
        assert_ne!(a, 0);
        assert_eq!(s.remove(a), Some("a"));
        assert_eq!(s.remove(a), None);
        let c = s.insert("c");
        assert_ne!(c, a, "a reused slot gets a new id");
        assert_eq!(s.get(a), None);
        assert_eq!(s.get(c), Some(&"c"));
        assert_eq!(s.get_mut(b).map(|v| *v), Some("b"));
        assert!(!s.is_empty());
        s.remove(b);
        s.remove(c);
        assert!(s.is_empty());
    }
}
