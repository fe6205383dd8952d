//! Field paths in a module's structure (`resnets.0.conv1`): which path lies under which, what a module holds at a
//! path, and which leaf group a path's weights travel with. Read from the structure alone, never from a weight;
//! shared by the views (`view`) and the model's split (`model`).

use burn::module::Module;

/// Whether the dotted path `path` lies strictly inside the module at `prefix`.
pub(crate) fn under(path: &str, prefix: &str) -> bool {
    path.strip_prefix(prefix).is_some_and(|rest| rest.starts_with('.'))
}

/// What a module holds at a dotted path, read from its structure without touching a weight.
#[derive(Default)]
pub(crate) struct Found<'p> {
    path: &'p str,
    stack: Vec<String>,
    /// A module (a field burn visits: an optional layer, `None` or not, a list, a layer) is at the path.
    pub module: bool,
    /// A float parameter is at or under the path.
    pub weights: bool,
}

impl<'p> Found<'p> {
    pub fn at<M: Module>(module: &M, path: &'p str) -> Self {
        let mut found = Found { path, ..Found::default() };
        module.visit(&mut found);
        found
    }
}

/// The leaf group of `leaves` (a module's, as leaf level cuts it) that [`leaf!`](crate::leaf) takes for the field
/// path `path`: the group at the path, or the group its weights travel with (a norm's, under no leaf of its own);
/// `None` where the module holds no weights at the path (an optional layer that is `None`), or where the path is a
/// module of several leaves (which `leaf!` refuses).
pub(crate) fn leaf_group_of<'g, M: Module>(module: &M, leaves: &'g [(String, u64)], path: &str) -> Option<&'g str> {
    let groups = leaves.iter().map(|(group, _)| group.as_str());
    if !path.is_empty() && groups.clone().any(|group| under(group, path)) {
        return None;
    }
    if let Some(exact) = groups.clone().find(|group| *group == path) {
        return Some(exact);
    }
    if !Found::at(module, path).weights {
        return None;
    }
    groups.filter(|group| group.is_empty() || under(path, group)).max_by_key(|group| group.len())
}

impl burn::module::ModuleVisitor for Found<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.stack.push(name.to_string());
        if self.stack.join(".") == self.path {
            self.module = true;
        }
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }

    fn visit_float<const D: usize>(&mut self, _param: &burn::module::Param<burn::tensor::Tensor<D>>) {
        let here = self.stack.join(".");
        if here == self.path || under(&here, self.path) {
            self.weights = true;
        }
    }
}
