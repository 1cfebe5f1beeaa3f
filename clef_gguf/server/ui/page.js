// What the page knows, shared by its modules: the server's base model and names, its limits (read from the server
// at start: /ui/limits.json), whether it takes images, and the images dropped so far.
export const page = { base: "", names: [], listed: {}, images: [], imagesOn: false, limits: null };
