//! `#[derive(OffloadModel)]`: a burn model declared once, in the shape it already has. Use it through
//! `group_offload` (which re-exports it); its documentation is `group_offload::OffloadModel`'s and the model
//! author's guide (`docs/model-guide.md`).
//!
//! The derive reads the struct's fields and their `#[offload(..)]` attributes and writes three items:
//!
//! - `{Model}Weights<'a>`: a `Copy` view of the weights, one field per declared part plus `shell` (the layers
//!   outside them), the same type whether the weights are resident or streamed, so the forward is written once;
//! - `{Model}Parts`: the model taken apart for group offload;
//! - the `OffloadModel` impl: `weights`, `streamed`, `split` (each declared part into its own groups, the rest
//!   into the shell) and `census` (the same parts for the planner).
//!
//! Field attributes, each on a field whose checkpoint keys stay as they are:
//!
//! | attribute | field type | view | groups at block level |
//! |---|---|---|---|
//! | `#[offload(blocks)]` | `Vec<B>` | `Blocks<'a, B>` | one per block (or per `blocks_per_group`) |
//! | `#[offload(block)]` | `B` | `Single<'a, B>` | one |
//! | `#[offload(nested)]` | `Vec<S>`, `S: OffloadModel` | `Nested<'a, S>` | each element's own parts, and its rest |
//! | `#[offload(nested)]` | `S: OffloadModel` | `S::Weights<'a>` | its own parts, and its rest |
//!
//! A declared part is never an `Option` (it is split into groups, so it exists in every model): an optional layer
//! lives inside a block, where its `Option` field streams at both levels.
//!
//! `blocks` and `block` take `first = path` (the leaf the block's forward takes first: `adaLN_modulation[0]`,
//! checked against the block's fields at compile time). Struct attributes: `#[offload(class = "Name")]` (the
//! class the record shows; the struct's name by default), `#[offload(leaves = path::to_fn)]` (a function
//! returning the `LeafPredicate` that cuts leaves; burn's layers by default), and `weights = Name`,
//! `parts = Name` for the generated types' names.

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as Tokens};
use quote::{format_ident, quote};
use syn::parse::ParseStream;
use syn::{Data, DeriveInput, Fields, GenericArgument, Ident, LitInt, LitStr, PathArguments, Type, parse_macro_input};

/// Declares a burn model to offload, from its struct: see the crate documentation and
/// `group_offload::OffloadModel`.
#[proc_macro_derive(OffloadModel, attributes(offload))]
pub fn derive_offload_model(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    match expand(&input) {
        Ok(tokens) => tokens.into(),
        Err(error) => error.to_compile_error().into(),
    }
}

/// What a field is declared as.
enum Kind {
    /// `#[offload(blocks)]` on `Vec<B>`.
    Blocks,
    /// `#[offload(block)]` on `B`.
    Block,
    /// `#[offload(nested)]` on `Vec<S>`.
    NestedList,
    /// `#[offload(nested)]` on `S`.
    NestedOne,
}

/// One declared field.
struct Declared {
    name: Ident,
    kind: Kind,
    /// The block or nested type (the element type of a `Vec`).
    ty: Type,
    /// The first leaf: its dotted path and the field-access tokens that check it.
    first: Option<(String, Tokens)>,
}

fn expand(input: &DeriveInput) -> syn::Result<Tokens> {
    let model = &input.ident;
    if !input.generics.params.is_empty() {
        return Err(syn::Error::new_spanned(
            &input.generics,
            "OffloadModel is derived for structs without generic parameters; write the impl by hand for a generic model",
        ));
    }
    let vis = &input.vis;
    let mut class = LitStr::new(&model.to_string(), model.span());
    let mut leaves: Option<syn::Path> = None;
    let mut weights = format_ident!("{}Weights", model);
    let mut parts = format_ident!("{}Parts", model);
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("offload")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("class") {
                class = meta.value()?.parse()?;
                Ok(())
            } else if meta.path.is_ident("leaves") {
                leaves = Some(meta.value()?.parse()?);
                Ok(())
            } else if meta.path.is_ident("weights") {
                weights = meta.value()?.parse()?;
                Ok(())
            } else if meta.path.is_ident("parts") {
                parts = meta.value()?.parse()?;
                Ok(())
            } else {
                Err(meta.error(
                    "unknown model attribute: use `class = \"Name\"`, `leaves = path::to_fn`, `weights = Name` or \
                     `parts = Name`",
                ))
            }
        })?;
    }
    let Data::Struct(data) = &input.data else {
        return Err(syn::Error::new_spanned(model, "OffloadModel is derived for structs with named fields"));
    };
    let Fields::Named(fields) = &data.fields else {
        return Err(syn::Error::new_spanned(model, "OffloadModel is derived for structs with named fields"));
    };
    let mut declared = Vec::new();
    for field in &fields.named {
        let Some(name) = field.ident.clone() else { continue };
        for attr in field.attrs.iter().filter(|a| a.path().is_ident("offload")) {
            let mut kind = None;
            let mut first = None;
            attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("blocks") || meta.path.is_ident("block") {
                    kind = Some(false);
                    Ok(())
                } else if meta.path.is_ident("nested") {
                    kind = Some(true);
                    Ok(())
                } else if meta.path.is_ident("first") {
                    first = Some(meta.value()?.call(parse_field_path)?);
                    Ok(())
                } else {
                    Err(meta.error("unknown field attribute: use `blocks`, `block`, `nested` or `first = path`"))
                }
            })?;
            let Some(nested) = kind else {
                return Err(syn::Error::new_spanned(attr, "say what the field is: `blocks`, `block` or `nested`"));
            };
            let (list, ty) = match vec_element(&field.ty) {
                Some(element) => (true, element.clone()),
                None => (false, field.ty.clone()),
            };
            if is_option(&ty) {
                // A declared part is split into groups when the model is taken apart, so it exists in every
                // model; an optional layer belongs inside a block, where it streams at both levels.
                return Err(syn::Error::new_spanned(
                    &field.ty,
                    "a declared part cannot be an `Option`: declare the list or module that holds the optional \
                     layer (its `Option` field streams at both levels: `match &leaf!(block, skip) { .. }` for one \
                     leaf, `narrow!(block, cross).some()` for a module of several), or leave the field unmarked, \
                     in the shell",
                ));
            }
            let kind = match (nested, list) {
                (false, true) => Kind::Blocks,
                (false, false) => Kind::Block,
                (true, true) => Kind::NestedList,
                (true, false) => Kind::NestedOne,
            };
            if first.is_some() && nested {
                return Err(syn::Error::new_spanned(
                    attr,
                    "`first` belongs on the block lists inside the nested type, not on the nested field",
                ));
            }
            declared.push(Declared { name: name.clone(), kind, ty, first });
        }
    }
    let leaf_types = leaves.map(|path| {
        quote! {
            fn leaf_types() -> ::group_offload::LeafPredicate {
                #path()
            }
        }
    });
    let doc_weights = format!("The weights of [`{model}`] as its forward reads them, resident or streamed.");
    let doc_parts = format!("[`{model}`] taken apart for group offload.");
    let krate = quote!(::group_offload);

    if declared.is_empty() {
        // A model with no declared parts moves only whole: its weights are the model itself.
        return Ok(quote! {
            impl #krate::OffloadModel for #model {
                const CLASS: &'static str = #class;
                type Weights<'a> = &'a #model;
                type Parts = ::std::convert::Infallible;
                fn weights(&self) -> &#model {
                    self
                }
                fn streamed(parts: &::std::convert::Infallible) -> &#model {
                    match *parts {}
                }
                #leaf_types
            }
        });
    }

    let mut view_fields = Vec::new();
    let mut part_fields = Vec::new();
    let mut resident = Vec::new();
    let mut streamed = Vec::new();
    let mut split = Vec::new();
    let mut census = Vec::new();
    for Declared { name, kind, ty, first } in &declared {
        let key = LitStr::new(&name.to_string(), Span::call_site());
        let doc = format!("The declared part `{name}`.");
        let (first_path, first_check) = match first {
            Some((path, access)) => {
                let path = LitStr::new(path, Span::call_site());
                (
                    quote!(::core::option::Option::Some(#path)),
                    quote!(let _ = |block: &#ty| { let _ = &block #access; };),
                )
            }
            None => (quote!(::core::option::Option::None), quote!()),
        };
        let (view, part) = match kind {
            Kind::Blocks => (quote!(#krate::Blocks<'a, #ty>), quote!(#krate::model::Streamed<#ty>)),
            Kind::Block => (quote!(#krate::Single<'a, #ty>), quote!(#krate::model::StreamedOne<#ty>)),
            Kind::NestedList => {
                (quote!(#krate::Nested<'a, #ty>), quote!(::std::vec::Vec<<#ty as #krate::OffloadModel>::Parts>))
            }
            Kind::NestedOne => {
                (quote!(<#ty as #krate::OffloadModel>::Weights<'a>), quote!(<#ty as #krate::OffloadModel>::Parts))
            }
        };
        view_fields.push(quote!(#[doc = #doc] pub #name: #view));
        part_fields.push(quote!(#name: #part));
        match kind {
            Kind::Blocks => {
                resident.push(quote!(#name: #krate::Blocks::Resident(&self.#name)));
                streamed.push(quote!(#name: #krate::Blocks::Streamed(&parts.#name)));
                split.push(quote!(let #name = split.blocks(#key, ::core::mem::take(&mut self.#name))?;));
                census.push(quote!(#first_check census.blocks_from(&self.#name, #first_path);));
            }
            Kind::Block => {
                resident.push(quote!(#name: #krate::Single::Resident(&self.#name)));
                streamed.push(quote!(#name: #krate::Single::Streamed(&parts.#name)));
                split.push(quote!(let #name = split.block(#key, split.hollow(&mut self.#name))?;));
                census
                    .push(quote!(#first_check census.blocks_from(::core::slice::from_ref(&self.#name), #first_path);));
            }
            Kind::NestedList => {
                resident.push(quote!(#name: #krate::Nested::Resident(&self.#name)));
                streamed.push(quote!(#name: #krate::Nested::Streamed(&parts.#name)));
                split.push(quote!(let #name = split.nested(#key, ::core::mem::take(&mut self.#name))?;));
                census.push(quote!(for element in &self.#name { census.nested(element); }));
            }
            Kind::NestedOne => {
                resident.push(quote!(#name: #krate::OffloadModel::weights(&self.#name)));
                streamed.push(quote!(#name: <#ty as #krate::OffloadModel>::streamed(&parts.#name)));
                split.push(quote!(let #name = split.nested_one(#key, split.hollow(&mut self.#name))?;));
                census.push(quote!(census.nested(&self.#name);));
            }
        }
    }
    let names: Vec<&Ident> = declared.iter().map(|d| &d.name).collect();
    Ok(quote! {
        #[doc = #doc_weights]
        #[derive(Clone, Copy)]
        #vis struct #weights<'a> {
            /// The layers outside the declared parts, resident or streamed as one group.
            pub shell: #krate::Shell<'a, #model>,
            #(#view_fields,)*
        }

        #[doc = #doc_parts]
        #vis struct #parts {
            shell: #krate::parts::ModuleOffload<#model>,
            #(#part_fields,)*
        }

        impl #krate::OffloadModel for #model {
            const CLASS: &'static str = #class;
            type Weights<'a> = #weights<'a>;
            type Parts = #parts;
            fn weights(&self) -> #weights<'_> {
                #weights { shell: #krate::Shell::Resident(self), #(#resident,)* }
            }
            fn streamed(parts: &#parts) -> #weights<'_> {
                #weights { shell: #krate::Shell::Streamed(&parts.shell), #(#streamed,)* }
            }
            fn split(mut self, split: &#krate::model::Split<'_>) -> #krate::Result<#parts> {
                #(#split)*
                ::core::result::Result::Ok(#parts { shell: split.shell(self)?, #(#names,)* })
            }
            fn census(&self, census: &mut #krate::model::Census) {
                #(#census)*
            }
            #leaf_types
        }
    })
}

/// The element type of `Vec<T>`, if the type is a `Vec`.
fn vec_element(ty: &Type) -> Option<&Type> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    if last.ident != "Vec" {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else { return None };
    match args.args.first()? {
        GenericArgument::Type(element) => Some(element),
        _ => None,
    }
}

/// Whether `ty` is `Option<..>`.
fn is_option(ty: &Type) -> bool {
    let Type::Path(path) = ty else { return false };
    path.path.segments.last().is_some_and(|last| last.ident == "Option")
}

/// A field path inside a block, `attention.to_out[0]`: its dotted form (`attention.to_out.0`, the group's
/// path) and the access tokens (`.attention.to_out[0]`) that make the compiler check it.
fn parse_field_path(input: ParseStream<'_>) -> syn::Result<(String, Tokens)> {
    let first: Ident = input.parse()?;
    let mut dotted = first.to_string();
    let mut access = quote!(.#first);
    loop {
        if input.peek(syn::Token![.]) {
            input.parse::<syn::Token![.]>()?;
            let field: Ident = input.parse()?;
            dotted.push('.');
            dotted.push_str(&field.to_string());
            access = quote!(#access.#field);
        } else if input.peek(syn::token::Bracket) {
            let content;
            syn::bracketed!(content in input);
            let index: LitInt = content.parse()?;
            dotted.push('.');
            dotted.push_str(index.base10_digits());
            access = quote!(#access[#index]);
        } else {
            return Ok((dotted, access));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::expand;

    /// The message of the derive's refusal of `input`.
    fn refused(input: syn::DeriveInput) -> String {
        match expand(&input) {
            Ok(tokens) => panic!("accepted: {tokens}"),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn an_optional_declared_part_is_refused_with_the_pattern_that_streams_it() {
        for input in [
            syn::parse_quote! { struct Model { #[offload(nested)] refiner: Option<Refiner> } },
            syn::parse_quote! { struct Model { #[offload(block)] cross: Option<Attention> } },
            syn::parse_quote! { struct Model { #[offload(blocks)] blocks: Vec<Option<Block>> } },
        ] {
            let message = refused(input);
            assert!(message.contains("cannot be an `Option`") && message.contains(".some()"), "{message}");
        }
    }

    #[test]
    fn a_field_attribute_that_says_nothing_is_refused() {
        let message = refused(syn::parse_quote! { struct Model { #[offload(first = fc)] blocks: Vec<Block> } });
        assert!(message.contains("`blocks`, `block` or `nested`"), "{message}");
    }

    #[test]
    fn the_declared_parts_are_accepted_in_the_shape_the_struct_has() {
        let input: syn::DeriveInput = syn::parse_quote! {
            #[offload(class = "Seq2Seq")]
            struct Model {
                embed: Embedding,
                #[offload(nested)] encoder: Side,
                #[offload(nested)] stages: Vec<Stage>,
                #[offload(blocks, first = attn.norm)] blocks: Vec<Block>,
                #[offload(block)] last: Block,
                skip: Option<Linear>,
            }
        };
        let tokens = expand(&input).expect("accepted").to_string();
        assert!(tokens.contains("ModelWeights") && tokens.contains("\"Seq2Seq\""), "{tokens}");
    }
}
